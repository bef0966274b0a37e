package main

import (
	"bufio"
	"context"
	"faregate/protect/kit/testkit/clocktest"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/agent/govern"
	"faregate/protect/budget"
	"faregate/protect/kit/testkit/redistest"
)

// The speed targets of the model endpoint (issue 21), each compared in
// the same run, in one process, on the same httptest upstream and one
// private redis-server (run:
//
//	go test -run '^$' -bench 'GovernedEndpoint|GovernedOpenStreams' -benchtime 3s ./cmd/faregate
//
// ; like every benchmark, none runs without -bench):
//   - direct: the client calls the upstream itself;
//   - proxy: a bare httputil.ReverseProxy, no Redis at all;
//   - endpoint: the model endpoint as run wires it (key check, the task's
//     limits, the Governor with budget, ledger, both buckets, the step);
//     endpoint-unbatched: the same on a client without redisbatch's hook;
//   - builtin: the built-in planner's governed call (Governor.Call) whose
//     attempt calls the upstream the same way the client does;
//   - budget-only: builtin with nothing but the budget (reserve, settle
//     and ledger entry): the floor of a per-call atomic shared budget.
//
// 32 workers make non-streaming calls; each variant reports p50 and p99
// latency, requests per second and, against direct, the added p50 and
// p99 (added-p50-µs, added-p99-µs) and its throughput against proxy
// (x-proxy), with the CPU of each call, ours and the redis-server's, and
// how many scripts (redis-scripts/op) and other Redis commands, most of
// them called by the scripts (redis-calls/op), each call made.
// BenchmarkGovernedEndpointThinking measures direct and endpoint again
// against an upstream that takes 20 ms, as a model would.

// speedClient is a client with enough idle connections for every worker.
func speedClient() *http.Client {
	return &http.Client{Transport: &http.Transport{MaxIdleConns: 4096, MaxIdleConnsPerHost: 4096}}
}

// latencies are one variant's results.
type latencies struct {
	p50, p99 time.Duration
	rps      float64
}

// run32 makes b.N calls of call from 32 workers and reports p50, p99,
// requests per second and the CPU each call cost this process
// (cpu-µs/op) and the redis-server (redis-cpu-µs/op, when rdb is set):
// on a machine other work shares, the CPU is the figure queueing does not
// blur. call returns the latency it measured.
func run32(b *testing.B, rdb *redis.Client, call func() (time.Duration, error)) latencies {
	return runN(b, 32, rdb, call)
}

// runN is run32 with workers workers.
func runN(b *testing.B, workers int, rdb *redis.Client, call func() (time.Duration, error)) latencies {
	lat := make([][]time.Duration, workers)
	next := make(chan struct{}, b.N)
	for range b.N {
		next <- struct{}{}
	}
	close(next)
	var wg sync.WaitGroup
	b.ResetTimer()
	start, cpu0, rcpu0 := time.Now(), processCPU(), redisCPU(b, rdb)
	scripts0, cmds0 := redisCommands(b, rdb)
	for w := range workers {
		wg.Go(func() {
			for range next {
				d, err := call()
				if err != nil {
					b.Error(err)
					return
				}
				lat[w] = append(lat[w], d)
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	b.StopTimer()
	b.ReportMetric(float64((processCPU()-cpu0).Microseconds())/float64(b.N), "cpu-µs/op")
	if rdb != nil {
		b.ReportMetric(float64((redisCPU(b, rdb)-rcpu0).Microseconds())/float64(b.N), "redis-cpu-µs/op")
		scripts, cmds := redisCommands(b, rdb)
		b.ReportMetric(float64(scripts-scripts0)/float64(b.N), "redis-scripts/op")
		b.ReportMetric(float64(cmds-cmds0)/float64(b.N), "redis-calls/op")
	}
	all := slices.Concat(lat...)
	slices.Sort(all)
	if len(all) == 0 {
		return latencies{}
	}
	l := latencies{p50: all[len(all)/2], p99: all[len(all)*99/100], rps: float64(len(all)) / elapsed.Seconds()}
	b.ReportMetric(float64(l.p50.Microseconds()), "p50-µs")
	b.ReportMetric(float64(l.p99.Microseconds()), "p99-µs")
	b.ReportMetric(l.rps, "req/s")
	return l
}

// jsonPost is a JSON POST of body to u, with key as the bearer if set.
func jsonPost(u, key, body string) *http.Request {
	req, _ := http.NewRequest(http.MethodPost, u, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	return req
}

// httpCall posts body to u (with key as the bearer, if set) and times it:
// to the whole answer, or with first to the first line of the stream.
func httpCall(client *http.Client, u, key, body string, first bool) func() (time.Duration, error) {
	return func() (time.Duration, error) {
		t0 := time.Now()
		resp, err := client.Do(jsonPost(u, key, body))
		if err != nil {
			return 0, err
		}
		defer resp.Body.Close()
		var d time.Duration
		if first {
			rd := bufio.NewReader(resp.Body)
			if _, err := rd.ReadString('\n'); err != nil {
				return 0, err
			}
			d = time.Since(t0)
			_, _ = io.Copy(io.Discard, rd)
		} else {
			_, _ = io.Copy(io.Discard, resp.Body)
			d = time.Since(t0)
		}
		if resp.StatusCode != http.StatusOK {
			return 0, fmt.Errorf("status %d", resp.StatusCode)
		}
		return d, nil
	}
}

// speedRig is the rig on a private redis-server, with a bare proxy to the
// same upstream beside it.
func speedRig(b *testing.B, upstream http.HandlerFunc, maxParallel int) (*endpointRig, *httptest.Server, *redis.Client) {
	redistest.Require(b)
	srv := redistest.Start(b)
	rig := newEndpointRig(b, srv.Client(b), upstream, maxParallel)
	target, _ := url.Parse(rig.upstream.URL)
	rp := httputil.NewSingleHostReverseProxy(target)
	rp.Transport = speedClient().Transport
	proxy := httptest.NewServer(rp)
	b.Cleanup(proxy.Close)
	return rig, proxy, srv.Client(b)
}

func BenchmarkGovernedEndpoint(b *testing.B) {
	rig, proxy, rdb := speedRig(b, answerJSON, 64)
	path := "/v1/chat/completions"
	var direct, bare latencies
	added := func(b *testing.B, l latencies) {
		b.ReportMetric(float64((l.p50 - direct.p50).Microseconds()), "added-p50-µs")
		b.ReportMetric(float64((l.p99 - direct.p99).Microseconds()), "added-p99-µs")
		if bare.rps > 0 {
			b.ReportMetric(l.rps/bare.rps, "x-proxy")
		}
	}
	b.Run("direct", func(b *testing.B) {
		direct = run32(b, rdb, httpCall(speedClient(), rig.upstream.URL+path, "", endpointBody, false))
	})
	b.Run("proxy", func(b *testing.B) {
		bare = run32(b, rdb, httpCall(speedClient(), proxy.URL+path, "", endpointBody, false))
		added(b, bare)
	})
	b.Run("endpoint", func(b *testing.B) {
		added(b, run32(b, rdb, httpCall(speedClient(), rig.endpoint.URL+path, rig.key, endpointBody, false)))
	})
	// The same endpoint with the budget's day scopes in leased blocks
	// (FAREGATE_BUDGET_LEASE_CALLS=64): its reserve and settle each one
	// script in the principal's slot.
	b.Run("endpoint-leased", func(b *testing.B) {
		leased := newEndpointRigWith(b, redis.NewClient(rdb.Options()), answerJSON, 64, nil, budget.LeaseOptions{Calls: budget.DefaultLeaseCalls})
		added(b, run32(b, rdb, httpCall(speedClient(), leased.endpoint.URL+path, leased.key, endpointBody, false)))
	})
	// The same endpoint on a client without redisbatch's hook: each
	// command of a round trip on a connection of its own (the cost the
	// hook saves).
	b.Run("endpoint-unbatched", func(b *testing.B) {
		plain := newEndpointRigOn(b, redis.NewClient(rdb.Options()), answerJSON, 64)
		added(b, run32(b, rdb, httpCall(speedClient(), plain.endpoint.URL+path, plain.key, endpointBody, false)))
	})
	// One call at a time: the overhead without the queueing that 32
	// callers on a 2-core machine make.
	var direct1 latencies
	b.Run("direct-serial", func(b *testing.B) {
		direct1 = runN(b, 1, rdb, httpCall(speedClient(), rig.upstream.URL+path, "", endpointBody, false))
	})
	b.Run("endpoint-serial", func(b *testing.B) {
		l := runN(b, 1, rdb, httpCall(speedClient(), rig.endpoint.URL+path, rig.key, endpointBody, false))
		b.ReportMetric(float64((l.p50 - direct1.p50).Microseconds()), "added-p50-µs")
		b.ReportMetric(float64((l.p99 - direct1.p99).Microseconds()), "added-p99-µs")
	})
	b.Run("builtin", func(b *testing.B) {
		up := httpCall(speedClient(), rig.upstream.URL+path, "", endpointBody, false)
		added(b, run32(b, rdb, governedCall(rig.gov, rig.spec, up)))
	})
	// The floor of an atomic shared budget per call: the same governed
	// call with nothing but the budget (its reservation before the call,
	// its settle with the ledger entry after: two scripts, two round
	// trips; no bucket, pacing, call limit or step). What this costs the
	// two cores besides the upstream is the least any design that asks
	// Redis on every call can spend.
	budgetOnly := func(lease budget.LeaseOptions) func(b *testing.B) {
		return func(b *testing.B) {
			bud := budget.New(rdb, budget.Options{Limits: budget.Limits{Site: 1 << 40, Principal: 1 << 40, Task: 1 << 40}, Lease: lease})
			b.Cleanup(func() { _ = bud.Close(context.Background()) })
			gov := govern.New(govern.Config{MaxTokens: 1000}, govern.Deps{
				Models: &govern.Models{Primary: govern.Model{Name: endpointModel}},
				Budget: bud,
				Ledger: budget.NewLedger(rdb, time.Now),
			})
			spec := rig.spec
			spec.Principal.TokensPerMinute = 0
			up := httpCall(speedClient(), rig.upstream.URL+path, "", endpointBody, false)
			added(b, run32(b, rdb, governedCall(gov, spec, up)))
		}
	}
	b.Run("budget-only", budgetOnly(budget.LeaseOptions{}))
	// The same with the day scopes in leased blocks: the reserve and the
	// settle each one script in the principal's slot, and the settles of
	// concurrent calls share a script (group commit).
	b.Run("budget-only-leased", budgetOnly(budget.LeaseOptions{Calls: budget.DefaultLeaseCalls}))
}

// governedCall times one governed call of spec whose attempt calls up,
// as the built-in planner's call would, reporting what the upstream sent.
func governedCall(gov *govern.Governor, spec govern.Spec, up func() (time.Duration, error)) func() (time.Duration, error) {
	return func() (time.Duration, error) {
		t0 := time.Now()
		_, err := gov.Call(context.Background(), spec, func(context.Context, govern.Attempt) (govern.Outcome, error) {
			if _, err := up(); err != nil {
				return govern.Outcome{}, err
			}
			return govern.Outcome{Usage: govern.Usage{Prompt: 20, Completion: 10, Reported: true}, Counted: 10, FirstToken: true}, nil
		})
		return time.Since(t0), err
	}
}

// BenchmarkGovernedEndpointThinking is BenchmarkGovernedEndpoint's
// direct and endpoint variants against an upstream that takes 20 ms to
// answer, as a model does (a real one takes longer): 32 callers then
// leave the two cores mostly idle, and the added p50 and p99 are the
// endpoint's own latency (its two Redis round trips, the hop, the
// checks) rather than the queueing that 32 instant answers make.
func BenchmarkGovernedEndpointThinking(b *testing.B) {
	thinking := func(w http.ResponseWriter, r *http.Request) {
		clocktest.Pass(20 * time.Millisecond) // a model thinking
		answerJSON(w, r)
	}
	rig, _, rdb := speedRig(b, thinking, 64)
	directAndEndpoint(b, rig, rdb, endpointBody, false)
}

// directAndEndpoint runs 32 workers posting body to /v1/chat/completions
// directly on rig's upstream, then through its endpoint, and reports the
// endpoint's added p50 and p99: to the whole answer, or with first to
// the first line of the stream.
func directAndEndpoint(b *testing.B, rig *endpointRig, rdb *redis.Client, body string, first bool) {
	path := "/v1/chat/completions"
	var direct latencies
	b.Run("direct", func(b *testing.B) {
		direct = run32(b, rdb, httpCall(speedClient(), rig.upstream.URL+path, "", body, first))
	})
	b.Run("endpoint", func(b *testing.B) {
		l := run32(b, rdb, httpCall(speedClient(), rig.endpoint.URL+path, rig.key, body, first))
		b.ReportMetric(float64((l.p50 - direct.p50).Microseconds()), "added-p50-µs")
		b.ReportMetric(float64((l.p99 - direct.p99).Microseconds()), "added-p99-µs")
	})
}

// streamJSON is an upstream that streams five chunks, the first flushed
// at once, then the usage and [DONE].
func streamJSON(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	w.Header().Set("Content-Type", "text/event-stream")
	for i := range 5 {
		_, _ = io.WriteString(w, `data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{"content":"word "}}]}`+"\n\n")
		if i == 0 {
			w.(http.Flusher).Flush()
		}
	}
	_, _ = io.WriteString(w, `data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[],"usage":{"prompt_tokens":20,"completion_tokens":5,"total_tokens":25}}`+"\n\n")
	_, _ = io.WriteString(w, "data: [DONE]\n\n")
}

// BenchmarkGovernedEndpointStream is the time to the first event of a
// stream (TTFT), direct and through the endpoint (added-p50-µs,
// added-p99-µs).
func BenchmarkGovernedEndpointStream(b *testing.B) {
	rig, _, rdb := speedRig(b, streamJSON, 64)
	body := strings.Replace(endpointBody, `"max_tokens"`, `"stream":true,"max_tokens"`, 1)
	directAndEndpoint(b, rig, rdb, body, true)
}

// BenchmarkGovernedOpenStreams holds 1,000 streams of one task open at
// once through the endpoint (FAREGATE_AGENT_MAX_PARALLEL raised to let
// them) and reports the memory each costs: the whole process (client,
// endpoint and upstream sides) and, against the same 1,000 streams opened
// directly on the upstream, the endpoint's own part; then the same with
// a 32 KiB prompt (an agent's conversation a few turns in), whose
// endpoint part is what the endpoint holds of a prompt it has forwarded
// (B/stream-endpoint-32KiB; the client's body is one string shared by
// every request, so neither side counts copies of it).
func BenchmarkGovernedOpenStreams(b *testing.B) {
	const n = 1000
	release := make(chan struct{})
	upstream := func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, `data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{"content":"first "}}]}`+"\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-release:
		case <-r.Context().Done():
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	}
	rig, _, _ := speedRig(b, upstream, 2*n)
	// The large prompts go to a task of their own, on a Redis of their
	// own: after the small ones its principal's input-spike check would
	// refuse them.
	bigRig, _, _ := speedRig(b, upstream, 2*n)
	body := strings.Replace(endpointBody, `"max_tokens"`, `"stream":true,"max_tokens"`, 1)
	bigBody := strings.Replace(body, `"Three days in Lisbon, food and history."`,
		`"`+strings.Repeat("Three days in Lisbon, food and history. ", 32<<10/40)+`"`, 1)
	goroutines := runtime.NumGoroutine()
	open := func(u, key, body string) (func(), int64) {
		// The streams of the round before must be gone (their handlers and
		// connections), or the base counts them and the difference goes
		// negative.
		clocktest.Poll(10*time.Second, func() bool { return runtime.NumGoroutine() <= goroutines })
		client := speedClient()
		base := inUse()
		bodies := make([]io.ReadCloser, 0, n)
		var mu sync.Mutex
		var ready sync.WaitGroup
		for range n {
			ready.Go(func() {
				resp, err := client.Do(jsonPost(u, key, body))
				if err != nil {
					b.Error(err)
					return
				}
				if resp.StatusCode != http.StatusOK {
					b.Errorf("status %d", resp.StatusCode)
				}
				if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
					b.Error(err)
				}
				mu.Lock()
				bodies = append(bodies, resp.Body)
				mu.Unlock()
			})
		}
		ready.Wait()
		used := inUse() - base // signed: a heap that shrank reads as less, not as 2^64
		return func() {
			for _, bd := range bodies {
				bd.Close()
			}
			client.CloseIdleConnections()
		}, used
	}
	path := "/v1/chat/completions"
	for range b.N {
		closeDirect, direct := open(rig.upstream.URL+path, "", body)
		closeDirect()
		closeEp, total := open(rig.endpoint.URL+path, rig.key, body)
		closeEp()
		b.ReportMetric(float64(total)/n, "B/stream-all")
		b.ReportMetric((float64(total)-float64(direct))/n, "B/stream-endpoint")
		closeDirect, direct = open(bigRig.upstream.URL+path, "", bigBody)
		closeDirect()
		closeEp, total = open(bigRig.endpoint.URL+path, bigRig.key, bigBody)
		closeEp()
		b.ReportMetric((float64(total)-float64(direct))/n, "B/stream-endpoint-32KiB")
	}
	close(release)
}

// processCPU is the CPU this process has used, user and system.
func processCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// redisCPU is the CPU the redis-server has used (INFO cpu), 0 without rdb.
func redisCPU(b *testing.B, rdb *redis.Client) time.Duration {
	if rdb == nil {
		return 0
	}
	info, err := rdb.Info(context.Background(), "cpu").Result()
	if err != nil {
		b.Fatal(err)
	}
	var total float64
	for line := range strings.Lines(info) {
		k, v, ok := strings.Cut(strings.TrimSpace(line), ":")
		if ok && (k == "used_cpu_sys" || k == "used_cpu_user") {
			f, _ := strconv.ParseFloat(v, 64)
			total += f
		}
	}
	return time.Duration(total * float64(time.Second))
}

// redisCommands counts the scripts the redis-server has run and the other
// commands (those the scripts called, and any sent alone) from INFO
// commandstats, leaving out the benchmark's own INFO: a count no load on
// the machine blurs, where the CPU figures are (0, 0 without rdb).
func redisCommands(b *testing.B, rdb *redis.Client) (scripts, cmds int64) {
	if rdb == nil {
		return 0, 0
	}
	info, err := rdb.Info(context.Background(), "commandstats").Result()
	if err != nil {
		b.Fatal(err)
	}
	for line := range strings.Lines(info) {
		name, rest, ok := strings.Cut(strings.TrimPrefix(strings.TrimSpace(line), "cmdstat_"), ":calls=")
		if !ok {
			continue
		}
		calls, _, _ := strings.Cut(rest, ",")
		n, _ := strconv.ParseInt(calls, 10, 64)
		switch name {
		case "evalsha", "eval", "evalsha_ro", "eval_ro":
			scripts += n
		case "info":
		default:
			cmds += n
		}
	}
	return scripts, cmds
}

// inUse is the memory in use after a collection: heap and goroutine
// stacks.
func inUse() int64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapInuse + m.StackInuse)
}
