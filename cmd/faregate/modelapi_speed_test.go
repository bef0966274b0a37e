package main

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/agent/govern"
	"faregate/agent/task"
	"faregate/agent/taskkey"
	"faregate/agent/tasklimits"
	"faregate/agent/taskstore"
	"faregate/agent/tokens"
	"faregate/protect/budget"
	"faregate/protect/kit/redisbatch"
	"faregate/protect/kit/testkit/redistest"
	"faregate/protect/policy"
	"faregate/protect/ratelimit"
)

// The model endpoint as run wires it (modelEndpoint), on a real Redis:
// the task key's check, the task's call and parallel limits
// (RedisLimits), the workflow's Governor with the real budget, ledger,
// principal bucket and site pacing, and the model step on the task's
// inbox. Its speed is measured against the same httptest upstream called
// directly and through a bare httputil.ReverseProxy (speed_bench_test.go).

const endpointModel = "gpt-4o-mini"

const endpointAnswer = `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"Lisbon has seven hills and a good tram."},"finish_reason":"stop"}],"usage":{"prompt_tokens":20,"completion_tokens":10,"total_tokens":30}}`

const endpointBody = `{"model":"gpt-4o-mini","messages":[{"role":"system","content":"You plan trips."},{"role":"user","content":"Three days in Lisbon, food and history."}],"max_tokens":200}`

// answerJSON is an upstream that answers every call at once.
func answerJSON(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(w, endpointAnswer)
}

// endpointRig is one running external task and the model endpoint its
// key calls, in front of an httptest upstream.
type endpointRig struct {
	upstream *httptest.Server
	endpoint *httptest.Server
	key      string
	gov      *govern.Governor
	spec     govern.Spec // a built-in planner's call of the same task
	// served, when set, is told when a request's handler has returned
	// (the settle comes after the answer reached the client).
	served func()
	// handler is what endpoint serves, to call in a goroutine of a test's
	// own.
	handler http.Handler
}

// newEndpointRig starts the rig on rdb. maxParallel is the task's
// FAREGATE_AGENT_MAX_PARALLEL.
func newEndpointRig(tb testing.TB, rdb redis.UniversalClient, upstream http.HandlerFunc, maxParallel int) *endpointRig {
	// As newRedis makes run's clients: the governed call's round trips go
	// as one pipeline (per node).
	rdb.AddHook(redisbatch.New(rdb))
	return newEndpointRigOn(tb, rdb, upstream, maxParallel)
}

// newEndpointRigOn is newEndpointRig on rdb as it is (without
// redisbatch's hook, each command of a round trip goes on its own).
func newEndpointRigOn(tb testing.TB, rdb redis.UniversalClient, upstream http.HandlerFunc, maxParallel int) *endpointRig {
	tb.Helper()
	return newEndpointRigVia(tb, rdb, upstream, maxParallel, nil)
}

// newEndpointRigVia is newEndpointRigOn whose model calls go through rt
// instead of run's model transport to the upstream (nil: they do).
func newEndpointRigVia(tb testing.TB, rdb redis.UniversalClient, upstream http.HandlerFunc, maxParallel int, rt http.RoundTripper) *endpointRig {
	tb.Helper()
	return newEndpointRigWith(tb, rdb, upstream, maxParallel, rt, budget.LeaseOptions{})
}

// newEndpointRigWith is newEndpointRigVia with the budget's leases
// (FAREGATE_BUDGET_LEASE_CALLS) as lease sets them.
func newEndpointRigWith(tb testing.TB, rdb redis.UniversalClient, upstream http.HandlerFunc, maxParallel int, rt http.RoundTripper,
	leases budget.LeaseOptions) *endpointRig {
	tb.Helper()
	tokens.ForModel(endpointModel) // the tables load once, at start-up in faregate
	ctx := context.Background()
	r := &endpointRig{upstream: httptest.NewServer(upstream)}
	tb.Cleanup(r.upstream.Close)
	// run's model transport (buildModels), with idle connections for
	// every worker of the benchmarks.
	tr := modelTransport()
	tr.MaxIdleConns, tr.MaxIdleConnsPerHost = 4096, 4096
	client := &http.Client{Transport: tr}
	if rt != nil {
		client = &http.Client{Transport: rt}
	}

	models := &govern.Models{Primary: govern.Model{Name: endpointModel, BaseURL: r.upstream.URL + "/v1", HTTPClient: client}}
	bud := budget.New(rdb, budget.Options{Limits: budget.Limits{Site: 1 << 40, Principal: 1 << 40, Task: 1 << 40}, Lease: leases})
	tb.Cleanup(func() { _ = bud.Close(context.Background()) })
	d := govern.Deps{
		Models:  models,
		Budget:  bud,
		Ledger:  budget.NewLedger(rdb, time.Now),
		Limiter: ratelimit.New(rdb, ratelimit.Options{}),
	}
	r.gov = govern.New(govern.Config{MaxTokens: 1000, SiteTokensPerMinute: 1_000_000_000}, d)

	store := taskstore.New(rdb)
	now := time.Now().UTC()
	rec := task.Record{Task: task.Task{ID: task.NewID(), Status: task.StatusQueued, CreatedAt: now, UpdatedAt: now,
		Steps: []task.Step{}, Warnings: []string{}}, Principal: "v_speed", Tier: "public", Day: now.Format("2006-01-02"),
		Limits: task.Limits{TokensPerDay: 1 << 40, TokensPerMinute: 1_000_000_000, TierTokens: 1 << 40}}
	if err := store.Create(ctx, rec); err != nil {
		tb.Fatal(err)
	}
	lease, _, err := store.Acquire(ctx, taskstore.Entry{ID: "1-1", Task: rec.ID}, "replica-a")
	if err != nil {
		tb.Fatal(err)
	}
	keys := taskkey.New(rdb, taskkey.Options{})
	if r.key, err = keys.Mint(ctx, lease, rec, now.Add(time.Hour)); err != nil {
		tb.Fatal(err)
	}
	r.spec = govern.Spec{TaskID: rec.ID, Principal: govern.PrincipalOf(&rec), Kind: "chat", PromptTokens: 30, MaxOutput: 200, Label: "plan"}

	h := modelEndpoint(modelEndpointParts{
		gov: r.gov, records: store.Get, keys: keys,
		limits: tasklimits.New(rdb, tasklimits.Options{Limits: tasklimits.Limits{Calls: -1, Embeddings: -1, Parallel: int64(maxParallel)}}),
		models: []string{endpointModel}, lg: slog.New(slog.DiscardHandler),
	}, rigErrors{})
	// The key's check as api's v1Auth makes it (its Watch of open requests
	// is a loop of its own, off the call's path, and left out here).
	r.handler = http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if r.served != nil {
			defer r.served()
		}
		tok, _ := policy.BearerToken(req.Header)
		g, err := keys.Authenticate(req.Context(), tok)
		if err != nil {
			http.Error(w, err.Error(), http.StatusUnauthorized)
			return
		}
		body, err := io.ReadAll(req.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		call := h.Chat
		if req.URL.Path == "/v1/responses" {
			call = h.Responses
		}
		call(w, req.WithContext(taskkey.WithGrant(req.Context(), g)), body)
	})
	r.endpoint = httptest.NewServer(r.handler)
	tb.Cleanup(r.endpoint.Close)
	return r
}

// rigErrors answers the endpoint's refusals with their text: the rig
// measures calls that succeed, and a refusal fails it.
type rigErrors struct{}

func (rigErrors) WriteError(w http.ResponseWriter, _ *http.Request, err error) {
	http.Error(w, err.Error(), http.StatusInternalServerError)
}

func (rigErrors) ErrorEvent(_ *http.Request, err error) []byte { return []byte(err.Error()) }

// post makes one call on the endpoint with the task's key.
func (r *endpointRig) post(tb testing.TB, client *http.Client, body string) {
	req, _ := http.NewRequest(http.MethodPost, r.endpoint.URL+"/v1/chat/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+r.key)
	resp, err := client.Do(req)
	if err != nil {
		tb.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		tb.Fatalf("endpoint: %d %s", resp.StatusCode, b)
	}
}

// nameOf names a command, a script by its keys.
func nameOf(cmd redis.Cmder) string {
	name := cmd.Name()
	if len(cmd.Args()) > 1 && (name == "evalsha" || name == "eval") {
		name += ":" + strings.Join(keysOf(cmd), ",")
	}
	return name
}

// keysOf names an EVALSHA's keys by what follows the hash tag.
func keysOf(cmd redis.Cmder) []string {
	args := cmd.Args()
	var out []string
	for _, a := range args[3:] {
		s, _ := a.(string)
		if !strings.HasPrefix(s, "faregate:") {
			break
		}
		if i := strings.LastIndex(s, "}"); i >= 0 {
			s = s[i+1:]
		}
		out = append(out, s)
	}
	return out
}

// TestGovernedEndpointRoundTrips counts the Redis round trips on the
// critical path of one call through the model endpoint, wired as run
// wires it, on a real redis-server and a cluster (when cluster tests are
// on): before the upstream call the task's slot (RedisLimits), the
// principal's bucket, the reservation and the site's turn are one round
// (the key's check is answered from the replica's cache, which it may
// trust for 250 ms); after it the settle with its ledger line, the site's
// turn, the principal's bucket, the slot's release and the model step are
// one.
func TestGovernedEndpointRoundTrips(t *testing.T) {
	targets := []struct {
		name string
		rdb  func(t *testing.T) redis.UniversalClient
	}{
		{"redis", func(t *testing.T) redis.UniversalClient {
			redistest.Require(t)
			return redistest.Start(t).Client(t)
		}},
		{"cluster", func(t *testing.T) redis.UniversalClient {
			redistest.WantCluster(t, false)
			return redistest.SharedCluster(t).Client(t)
		}},
	}
	for _, tg := range targets {
		t.Run(tg.name, func(t *testing.T) {
			rdb := tg.rdb(t)
			// On a cluster the reservation and its settle are a script in
			// each slot they touch, sent together: the principal's bucket
			// of the budget and, per call while leases are off, the day's.
			parts := 1
			if tg.name == "cluster" {
				parts = 2
			}
			h := &redistest.Rounds{Name: nameOf}
			var before, beforePipes int
			var beforeNames []string
			counting := false
			rig := newEndpointRig(t, rdb, func(w http.ResponseWriter, r *http.Request) {
				if counting {
					before, beforeNames, beforePipes = h.Mark()
					h.Expect(4 + parts)
				}
				answerJSON(w, r)
			}, 4)
			done := make(chan struct{}, 1)
			rig.served = func() { done <- struct{}{} }
			client := &http.Client{}
			// A first call loads the scripts and the task's principal, and
			// the key's check fills the cache; then the counting starts.
			rig.post(t, client, endpointBody)
			<-done
			rdb.AddHook(h)
			counting = true
			h.Expect(3 + parts)
			rig.post(t, client, endpointBody)
			<-done
			after, afterNames, afterPipes := h.Mark()
			t.Logf("before the upstream call: %d round trips (%d pipelines) %v; after: %d round trips (%d pipelines) %v",
				before, beforePipes, beforeNames, after, afterPipes, afterNames)
			if before != 1 || len(beforeNames) != 3+parts {
				t.Fatalf("before the upstream call: %d round trips of %d commands; want the slot, the bucket, the reservation (%d scripts) and the site's turn in 1", before, len(beforeNames), parts)
			}
			if after != 1 || len(afterNames) != 4+parts {
				t.Fatalf("after the upstream call: %d round trips of %d commands; want the settle (%d scripts), the site's turn, the bucket, the slot and the step in 1", after, len(afterNames), parts)
			}
			// With redisbatch's hook each round is one write per node: one
			// pipeline on a single redis-server.
			if tg.name == "redis" && (beforePipes != 1 || afterPipes != 1) {
				t.Fatalf("round trips written as %d and %d pipelines; want 1 each", beforePipes, afterPipes)
			}
			// Nothing is left booked: the slot is back, the call counted
			// once, its step on the inbox.
			ctx := context.Background()
			if c, err := tasklimits.New(rdb, tasklimits.Options{}).Read(ctx, rig.spec.TaskID); err != nil || c != (tasklimits.Counts{Calls: 2}) {
				t.Fatalf("the task's limits after the calls: %+v, %v; want 2 calls counted, none in flight", c, err)
			}
			if n, err := rdb.XLen(ctx, "faregate:task:{"+rig.spec.TaskID+"}:inbox").Result(); err != nil || n != 2 {
				t.Fatalf("model steps: %d, %v; want 2", n, err)
			}
		})
	}
}

// The model transport's 1 KiB buffers bound nothing a provider may send:
// a header line, an SSE event and a request body several times their
// size pass whole (textproto joins a header line over reads; a body or a
// read past the buffer goes around it).
func TestGovernedModelTransportLongLines(t *testing.T) {
	event := "data: " + strings.Repeat("e", 10_000) + "\n\n"
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n, _ := io.Copy(io.Discard, r.Body)
		w.Header().Set("X-Long", strings.Repeat("h", 3000))
		w.Header().Set("X-Body", strconv.FormatInt(n, 10))
		w.Header().Set("Content-Type", "text/event-stream")
		w.(http.Flusher).Flush()
		_, _ = io.WriteString(w, event)
	}))
	defer up.Close()
	client := &http.Client{Transport: modelTransport()}
	resp, err := client.Post(up.URL, "application/json", strings.NewReader(strings.Repeat("b", 64<<10)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	got, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Header.Get("X-Long")) != 3000 || resp.Header.Get("X-Body") != "65536" || string(got) != event {
		t.Fatalf("header %d bytes, body seen %q, event %d bytes", len(resp.Header.Get("X-Long")), resp.Header.Get("X-Body"), len(got))
	}
}
