package gateway

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"faregate/agent/govern"
	"faregate/agent/offline"
	"faregate/agent/tasklimits"
	"faregate/agent/tokens"
	"faregate/protect/kit/testkit/redistest"
)

// Speed of the endpoint beside its baselines, in one process on the same
// httptest upstream (run: go test -run '^$' -bench 'Endpoint|OpenStreams'
// -benchtime 3s ./agent/gateway):
//   - direct: the client calls the upstream itself;
//   - proxy: a bare httputil.ReverseProxy, no checks at all;
//   - gateway: this handler with a governor that only attempts (the
//     whole governed endpoint on a real Redis is measured in
//     cmd/faregate: BenchmarkGovernedEndpoint).
// Each runs 32 concurrent non-streaming calls and reports p50 and p99
// latency and requests per second; the stream variants report the time to
// the first event.

const benchAnswer = `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"Lisbon has seven hills and a good tram."},"finish_reason":"stop"}],"usage":{"prompt_tokens":20,"completion_tokens":10,"total_tokens":30}}`

const benchBody = `{"model":"gpt-4o-mini","messages":[{"role":"system","content":"You plan trips."},{"role":"user","content":"Three days in Lisbon, food and history."}],"max_tokens":200}`

// passGov attempts once with a fixed grant: the governor's own cost is
// left out so the numbers are this package's.
type passGov struct{ up Upstream }

func (g passGov) Call(ctx context.Context, spec govern.Spec, attempt func(context.Context, govern.Attempt) (govern.Outcome, error)) (govern.Result, error) {
	var end govern.HoldEnd
	if spec.Hold != nil {
		e, err := spec.Hold(ctx)
		if err != nil {
			return govern.Result{}, err
		}
		end = e
	}
	out, err := attempt(ctx, govern.Attempt{Model: modelOf(spec.Model, g.up), MaxOutput: 1000})
	res := govern.Result{Outcome: out}
	if end != nil {
		end(ctx, res, err)
	}
	return res, err
}

func benchClient() *http.Client {
	return &http.Client{Transport: &http.Transport{MaxIdleConns: 2048, MaxIdleConnsPerHost: 2048}}
}

type benchSetup struct {
	upstream, proxy, gateway *httptest.Server
}

func newBench(b *testing.B, upstream http.HandlerFunc) *benchSetup {
	tokens.ForModel(testModel) // the tables load once per process, at start-up in faregate
	s := &benchSetup{upstream: httptest.NewServer(upstream)}
	b.Cleanup(s.upstream.Close)
	target, _ := url.Parse(s.upstream.URL)
	rp := httputil.NewSingleHostReverseProxy(target)
	rp.Transport = benchClient().Transport
	s.proxy = httptest.NewServer(rp)
	b.Cleanup(s.proxy.Close)
	h := New(Options{
		Governor: passGov{Upstream{BaseURL: s.upstream.URL + "/v1", Client: benchClient()}},

		Records: testRecords,
		Task:    func(*http.Request) (Task, bool) { return Task{ID: "t_bench", Models: []string{testModel}}, true },
		Errors:  testErrorWriter{},
		// The repetition cut is on in production (FAREGATE_LOOP_CUT).
		LoopThreshold: 0.8,
	})
	s.gateway = httptest.NewServer(testMux(h))
	b.Cleanup(s.gateway.Close)
	return s
}

// run makes b.N calls from 32 workers and reports latency percentiles
// and throughput. first, when set, times only until the first event.
func run32(b *testing.B, url, body string, first bool) {
	client := benchClient()
	const workers = 32
	lat := make([][]time.Duration, workers)
	var wg sync.WaitGroup
	next := make(chan struct{}, b.N)
	for range b.N {
		next <- struct{}{}
	}
	close(next)
	b.ResetTimer()
	start, cpu0 := time.Now(), cpuTime()
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range next {
				t0 := time.Now()
				req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
				req.Header.Set("Content-Type", "application/json")
				resp, err := client.Do(req)
				if err != nil {
					b.Error(err)
					return
				}
				if first {
					rd := bufio.NewReader(resp.Body)
					if _, err := rd.ReadString('\n'); err != nil {
						b.Error(err)
					}
					lat[w] = append(lat[w], time.Since(t0))
					_, _ = io.Copy(io.Discard, rd)
				} else {
					_, _ = io.Copy(io.Discard, resp.Body)
					lat[w] = append(lat[w], time.Since(t0))
				}
				resp.Body.Close()
				if resp.StatusCode != 200 {
					b.Errorf("status %d", resp.StatusCode)
					return
				}
			}
		}()
	}
	wg.Wait()
	elapsed, cpu := time.Since(start), cpuTime()-cpu0
	b.StopTimer()
	b.ReportMetric(float64(cpu.Microseconds())/float64(b.N), "cpu-µs/op")
	all := slices.Concat(lat...)
	slices.Sort(all)
	if len(all) == 0 {
		return
	}
	b.ReportMetric(float64(all[len(all)/2].Microseconds()), "p50-µs")
	b.ReportMetric(float64(all[len(all)*99/100].Microseconds()), "p99-µs")
	b.ReportMetric(float64(len(all))/elapsed.Seconds(), "req/s")
}

func BenchmarkEndpoint(b *testing.B) {
	s := newBench(b, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, benchAnswer)
	})
	b.Run("direct", func(b *testing.B) { run32(b, s.upstream.URL+"/v1/chat/completions", benchBody, false) })
	b.Run("proxy", func(b *testing.B) { run32(b, s.proxy.URL+"/v1/chat/completions", benchBody, false) })
	b.Run("gateway", func(b *testing.B) { run32(b, s.gateway.URL+"/v1/chat/completions", benchBody, false) })
	// With the per-task limits on a real redis-server: one script before
	// the call and one after it, as in production (the governor's own
	// round trips come on top).
	b.Run("gateway+limits", func(b *testing.B) {
		redistest.Require(b)
		rb := redistest.Private(b)
		h := New(Options{
			Governor: passGov{Upstream{BaseURL: s.upstream.URL + "/v1", Client: benchClient()}},

			Records: testRecords,
			Limits:  tasklimits.New(rb.Client, tasklimits.Options{Limits: tasklimits.Limits{Calls: -1, Embeddings: -1, Parallel: 64}}),
			Task:    func(*http.Request) (Task, bool) { return Task{ID: "t_bench", Models: []string{testModel}}, true },
			Errors:  testErrorWriter{},
		})
		gw := httptest.NewServer(testMux(h))
		b.Cleanup(gw.Close)
		run32(b, gw.URL+"/v1/chat/completions", benchBody, false)
	})
}

func BenchmarkEndpointStreamFirstEvent(b *testing.B) {
	s := newBench(b, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range 5 {
			_, _ = io.WriteString(w, chunkJSON("word ")+"\n\n")
			if i == 0 {
				w.(http.Flusher).Flush()
			}
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	})
	body := strings.Replace(benchBody, `"max_tokens"`, `"stream":true,"max_tokens"`, 1)
	stream := func(b *testing.B, url string) { run32(b, url, body, true) }
	b.Run("direct", func(b *testing.B) { stream(b, s.upstream.URL+"/v1/chat/completions") })
	b.Run("gateway", func(b *testing.B) { stream(b, s.gateway.URL+"/v1/chat/completions") })
}

// BenchmarkOpenStreams holds 1,000 streams open at once and reports the
// memory each costs: the whole process (client, gateway and upstream
// sides) and, against the same 1,000 streams opened directly on the
// upstream, the gateway's own part.
func BenchmarkOpenStreams(b *testing.B) {
	const n = 1000
	release := make(chan struct{})
	var ready sync.WaitGroup
	up := func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, chunkJSON("first ")+"\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-release:
		case <-r.Context().Done():
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	}
	s := newBench(b, up)
	body := strings.Replace(benchBody, `"max_tokens"`, `"stream":true,"max_tokens"`, 1)
	open := func(url string) (func(), uint64) {
		client := benchClient()
		base := heap()
		bodies := make([]io.ReadCloser, 0, n)
		var mu sync.Mutex
		ready.Add(n)
		for range n {
			go func() {
				defer ready.Done()
				req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
				req.Header.Set("Content-Type", "application/json")
				resp, err := client.Do(req)
				if err != nil {
					b.Error(err)
					return
				}
				rd := bufio.NewReader(resp.Body)
				if _, err := rd.ReadString('\n'); err != nil {
					b.Error(err)
				}
				mu.Lock()
				bodies = append(bodies, resp.Body)
				mu.Unlock()
			}()
		}
		ready.Wait()
		used := heap() - base
		return func() {
			for _, bd := range bodies {
				bd.Close()
			}
			client.CloseIdleConnections()
		}, used
	}
	for range b.N {
		closeDirect, direct := open(s.upstream.URL + "/v1/chat/completions")
		closeDirect()
		closeGw, total := open(s.gateway.URL + "/v1/chat/completions")
		closeGw()
		b.ReportMetric(float64(total)/n, "B/stream-all")
		b.ReportMetric((float64(total)-float64(direct))/n, "B/stream-gateway")
	}
	close(release)
}

// heap is the memory in use after a collection: heap and goroutine stacks.
func heap() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapInuse + m.StackInuse
}

// BenchmarkHandlerCPU is the handler's own work per non-streamed call,
// without sockets: parse, check, estimate, patch, relay and count, with
// the upstream served in process. On a loaded machine this is the figure
// that queueing does not blur.
func BenchmarkHandlerCPU(b *testing.B) {
	tokens.ForModel(testModel)
	up := offline.HandlerTransport(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, benchAnswer)
	}))
	for _, loop := range []float64{0, 0.8} {
		b.Run(map[float64]string{0: "loop cut off", 0.8: "loop cut on"}[loop], func(b *testing.B) {
			h := New(Options{
				Governor: passGov{Upstream{BaseURL: "http://up/v1", Client: &http.Client{Transport: up}}},

				Records:       testRecords,
				Task:          func(*http.Request) (Task, bool) { return Task{ID: "t_bench", Models: []string{testModel}}, true },
				Errors:        testErrorWriter{},
				LoopThreshold: loop,
			})
			handlerCPU(b, h)
		})
	}
}

// handlerCPU times h's chat route on benchBody, in process.
func handlerCPU(b *testing.B, h Handlers) {
	b.ReportAllocs()
	n, cpu0 := 0, time.Duration(0)
	for b.Loop() {
		if n == 0 {
			cpu0 = cpuTime()
		}
		n++
		req := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
		w := httptest.NewRecorder()
		h.Chat(w, req, []byte(benchBody))
		if w.Code != 200 {
			b.Fatal(w.Code)
		}
	}
	b.ReportMetric(float64((cpuTime()-cpu0).Microseconds())/float64(n), "cpu-µs/op")
}

// cpuTime is the CPU the process has used, user and system: on a machine
// other work shares, what a call costs is this, not the wall clock.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
