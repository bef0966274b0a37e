package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"faregate/protect/kit/testkit/redistest"
)

// weatherServer is an Open-Meteo-compatible forecast API that records what
// it was asked.
type weatherServer struct {
	*httptest.Server
	mu       sync.Mutex
	requests []*http.Request
	handler  func(w http.ResponseWriter, r *http.Request)
}

func newWeatherServer(t testing.TB, h func(w http.ResponseWriter, r *http.Request)) *weatherServer {
	ws := &weatherServer{handler: h}
	ws.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ws.mu.Lock()
		ws.requests = append(ws.requests, r.Clone(context.Background()))
		ws.mu.Unlock()
		ws.handler(w, r)
	}))
	t.Cleanup(ws.Close)
	return ws
}

func (ws *weatherServer) Requests() []*http.Request {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	return append([]*http.Request(nil), ws.requests...)
}

func forecastOK(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	fmt.Fprint(w, `{"latitude":38.7,"longitude":-9.1,"timezone":"Europe/Lisbon","daily":{"time":["2026-11-30","2026-12-01","2026-12-02"],
"temperature_2m_max":[17.1,16.0,15.2],"temperature_2m_min":[10.2,9.8,9.1],"precipitation_probability_max":[10,40,80],"weather_code":[1,3,61]}}`)
}

// TestOpenAIPathDedupesToolCallsWithHonestHeaders: a real-provider run (the
// openai provider against a fake /chat/completions) that asks for the
// weather three times with identical arguments makes one request to the
// weather server, and that request introduces itself honestly.
func TestOpenAIPathDedupesToolCallsWithHonestHeaders(t *testing.T) {
	ws := newWeatherServer(t, forecastOK)
	llm := newFakeLLM(t, func(req chatRequest, n int) fakeReply {
		if len(req.Tools) > 0 && req.toolResults() < 3 {
			// Same arguments, different spacing and key case of values.
			args := []string{`{"location":"Lisbon"}`, `{ "location" : "Lisbon" }`, `{"location":"lisbon "}`}[req.toolResults()]
			return fakeReply{ToolCalls: []fakeCall{{"weather", args}}}
		}
		return fakeReply{Content: itinerary(2, "")}
	})
	s := startServer(t, map[string]string{"FAREGATE_LLM_BASE_URL": llm.BaseURL(), "FAREGATE_LLM_MODEL": "test-model",
		"FAREGATE_WEATHER_URL": ws.URL, "FAREGATE_GEOCODING_URL": ws.URL, "FAREGATE_PUBLIC_URL": "https://demo.example"})
	r := do(t, "POST", s.URL+"/api/tasks", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Lisbon","days":2}`, nil)
	if r.Status != 202 {
		t.Fatalf("create: %d %s", r.Status, r.Raw)
	}
	task := waitTask(t, s.URL, r.Body["id"].(string))
	if task["status"] != "succeeded" {
		t.Fatalf("task: %v", task)
	}
	reqs := ws.Requests()
	if len(reqs) != 1 {
		t.Fatalf("weather server saw %d requests for 3 identical calls, want 1", len(reqs))
	}
	h := reqs[0].Header
	ua := h.Get("User-Agent")
	if !strings.HasPrefix(ua, "faregate-agent/") || !strings.Contains(ua, "+https://demo.example") || strings.Contains(ua, "Mozilla") {
		t.Errorf("User-Agent %q is not the honest one", ua)
	}
	if h.Get("X-AITF-Opt-In") != "true" || h.Get("X-AITF-Tool-Call-Id") == "" || h.Get("X-AITF-Depth") == "" {
		t.Errorf("AITF headers missing: %v", h)
	}
	cached := 0
	for _, st := range task["steps"].([]any) {
		if m := st.(map[string]any); m["name"] == "weather" && m["status"] == "cached" {
			cached++
		}
	}
	if cached != 2 {
		t.Errorf("cached weather steps = %d, want 2", cached)
	}
	// What the provider was sent: our model, the completion limit, the tools.
	first := llm.Requests()[0]
	if first.Model != "test-model" || first.MaxCompletionTokens != 1024 || !first.Stream {
		t.Errorf("first request: model %q max_completion_tokens %d stream %v", first.Model, first.MaxCompletionTokens, first.Stream)
	}
	if got := strings.Join(first.toolNames(), ","); !strings.Contains(got, "guide_search") || !strings.Contains(got, "weather") || !strings.Contains(got, "fetch_page") {
		t.Errorf("tools offered: %s", got)
	}
	usage := task["usage"].(map[string]any)
	if usage["prompt_tokens"].(float64) <= 0 || usage["completion_tokens"].(float64) <= 0 {
		t.Errorf("usage not recorded: %v", usage)
	}
	t.Logf("3 identical weather calls → %d downstream request; %d model calls", len(reqs), len(llm.Requests()))
}

// TestLegacyMaxTokensField: Ollama-style servers get max_tokens.
func TestLegacyMaxTokensField(t *testing.T) {
	llm := newFakeLLM(t, func(chatRequest, int) fakeReply { return fakeReply{Content: itinerary(1, "")} })
	s := startServer(t, map[string]string{"FAREGATE_LLM_BASE_URL": llm.BaseURL(), "FAREGATE_LLM_LEGACY_MAX_TOKENS": "true",
		"FAREGATE_LLM_MAX_TOKENS": "300"})
	r := do(t, "POST", s.URL+"/api/tasks", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Rome","days":1}`, nil)
	if task := waitTask(t, s.URL, r.Body["id"].(string)); task["status"] != "succeeded" {
		t.Fatalf("task: %v", task)
	}
	if req := llm.Requests()[0]; req.MaxTokens != 300 || req.MaxCompletionTokens != 0 {
		t.Fatalf("max_tokens %d, max_completion_tokens %d; want 300 and absent", req.MaxTokens, req.MaxCompletionTokens)
	}
}

// TestWeatherRetriesAreCapped: a forecast API answering 503 with
// Retry-After: 1 gets at most 3 requests, and the task still succeeds, with
// weather_unavailable. With the API down entirely, the same.
func TestWeatherRetriesAreCapped(t *testing.T) {
	for _, tc := range []struct {
		name string
		down bool
	}{{"503 retry-after", false}, {"down", true}} {
		t.Run(tc.name, func(t *testing.T) {
			ws := newWeatherServer(t, func(w http.ResponseWriter, _ *http.Request) {
				w.Header().Set("Retry-After", "1")
				w.WriteHeader(http.StatusServiceUnavailable)
			})
			url := ws.URL
			if tc.down {
				url = deadURL(t)
			}
			s := startServer(t, map[string]string{"FAREGATE_WEATHER_URL": url, "FAREGATE_GEOCODING_URL": url})
			r := do(t, "POST", s.URL+"/api/tasks", taskBody("Lisbon"), nil)
			task := waitTask(t, s.URL, r.Body["id"].(string))
			if task["status"] != "succeeded" {
				t.Fatalf("task: %v", task)
			}
			if !strings.Contains(fmt.Sprint(task["result"].(map[string]any)["warnings"]), "weather_unavailable") {
				t.Fatalf("warnings: %v", task["result"])
			}
			// The plan degraded as designed: the weather step says so and
			// what it used instead, it is not a failure (#19 item 21).
			weatherStep(t, task, "degraded", "seasonal norms")
			if n := len(ws.Requests()); n > 3 || (!tc.down && n < 2) {
				t.Fatalf("weather server saw %d requests, want 2..3 (one try and capped retries)", n)
			}
			t.Logf("%s: %d downstream requests", tc.name, len(ws.Requests()))
		})
	}
}

// weatherStep checks that every weather step of a finished task has the
// status and a detail containing detail.
func weatherStep(t *testing.T, task map[string]any, status, detail string) {
	t.Helper()
	n := 0
	for _, st := range task["steps"].([]any) {
		st := st.(map[string]any)
		if st["name"] != "weather" {
			continue
		}
		n++
		if st["status"] != status || !strings.Contains(fmt.Sprint(st["detail"]), detail) {
			t.Errorf("weather step %v, want status %s and a detail that says %q", st, status, detail)
		}
	}
	if n == 0 {
		t.Errorf("no weather step in %v", task["steps"])
	}
}

// TestToolLoopStopsAtStepBound: a model that calls tools forever is stopped
// at FAREGATE_AGENT_MAX_STEPS tool-capable calls plus one closing call.
func TestToolLoopStopsAtStepBound(t *testing.T) {
	var n atomic.Int64
	llm := newFakeLLM(t, func(req chatRequest, _ int) fakeReply {
		if len(req.Tools) == 0 {
			return fakeReply{Content: itinerary(2, "")}
		}
		i := n.Add(1)
		return fakeReply{ToolCalls: []fakeCall{{"guide_search", fmt.Sprintf(`{"query":"Lisbon page %d"}`, i)}}}
	})
	s := startServer(t, map[string]string{"FAREGATE_LLM_BASE_URL": llm.BaseURL(), "FAREGATE_AGENT_MAX_STEPS": "4"})
	r := do(t, "POST", s.URL+"/api/tasks", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Lisbon","days":2}`, nil)
	task := waitTask(t, s.URL, r.Body["id"].(string))
	reqs := llm.Requests()
	withTools := 0
	for _, q := range reqs {
		if len(q.Tools) > 0 {
			withTools++
		}
	}
	if withTools != 4 || len(reqs) != 5 {
		t.Fatalf("model calls: %d with tools, %d in all; want 4 and 5", withTools, len(reqs))
	}
	if task["status"] != "succeeded" || !strings.Contains(fmt.Sprint(task["warnings"]), "step_limit") {
		t.Fatalf("task: status %v warnings %v", task["status"], task["warnings"])
	}
	t.Logf("tool loop: %d model calls (%d with tools), warnings %v", len(reqs), withTools, task["warnings"])
}

// TestRepeatedToolCallIsALoop: the third identical call withdraws the tools.
func TestRepeatedToolCallIsALoop(t *testing.T) {
	llm := newFakeLLM(t, func(req chatRequest, _ int) fakeReply {
		if len(req.Tools) == 0 {
			return fakeReply{Content: itinerary(1, "")}
		}
		return fakeReply{ToolCalls: []fakeCall{{"guide_search", `{"query":"Rome"}`}}}
	})
	s := startServer(t, map[string]string{"FAREGATE_LLM_BASE_URL": llm.BaseURL()})
	r := do(t, "POST", s.URL+"/api/tasks", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Rome","days":1}`, nil)
	task := waitTask(t, s.URL, r.Body["id"].(string))
	if task["status"] != "succeeded" || !strings.Contains(fmt.Sprint(task["warnings"]), "tool_loop") {
		t.Fatalf("task: %v", task)
	}
	if n := len(llm.Requests()); n != 4 {
		t.Fatalf("model calls = %d, want 4 (3 identical tool calls, then the closing call)", n)
	}
}

// TestEventsResumeWithoutDuplicates: a client connecting mid-run gets the
// remaining steps and done; one reconnecting with Last-Event-ID gets no
// duplicates; a late client replays everything.
func TestEventsResumeWithoutDuplicates(t *testing.T) {
	llm := newFakeLLM(t, func(req chatRequest, n int) fakeReply {
		rep := plannerScript(2)(req, n)
		rep.Delay = 300 * time.Millisecond
		return rep
	})
	s := startServer(t, map[string]string{"FAREGATE_LLM_BASE_URL": llm.BaseURL(), "FAREGATE_WEATHER_URL": deadURL(t)})
	r := do(t, "POST", s.URL+"/api/tasks", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Lisbon","days":2}`, nil)
	id := r.Body["id"].(string)
	events := s.URL + "/api/tasks/" + id + "/events"

	first := readSSE(t, events, "", 3) // mid-run: the first three, then hang up
	if len(first) != 3 {
		t.Fatalf("first connection got %d events", len(first))
	}
	rest := readSSE(t, events, first[len(first)-1].ID, 0)
	if len(rest) == 0 || rest[len(rest)-1].Type != "done" {
		t.Fatalf("resumed stream did not end with done: %v", rest)
	}
	seen := map[string]bool{}
	for _, e := range append(first, rest...) {
		if seen[e.ID] {
			t.Fatalf("event %s delivered twice", e.ID)
		}
		seen[e.ID] = true
	}
	var done map[string]any
	if err := json.Unmarshal([]byte(rest[len(rest)-1].Data), &done); err != nil || done["status"] != "succeeded" {
		t.Fatalf("done event: %v %s", err, rest[len(rest)-1].Data)
	}
	all := readSSE(t, events, "", 0)
	if len(all) != len(first)+len(rest) {
		t.Fatalf("replay from the start: %d events, want %d", len(all), len(first)+len(rest))
	}
	steps := 0
	for _, e := range all {
		if e.Type == "step" {
			steps++
		}
	}
	t.Logf("events: %d in all (%d step events), resumed after %s", len(all), steps, first[len(first)-1].ID)
}

// TestTwoReplicasShareOneBudget: two servers on one Redis, hammered
// together, never spend more than the site budget.
func TestTwoReplicasShareOneBudget(t *testing.T) {
	be := redistest.Private(t) // a flood: a redis-server of its own
	const budget = 30000
	env := realRedisEnv(be.URL, map[string]string{
		"FAREGATE_DAILY_TOKEN_BUDGET": fmt.Sprint(budget), "FAREGATE_IP_DAILY_TOKENS": "1000000", "FAREGATE_TASK_TOKEN_LIMIT": "1000000",
		"FAREGATE_IP_DAILY_LIMIT": "1000", "FAREGATE_GLOBAL_DAILY_LIMIT": "100000", "FAREGATE_TRUSTED_PROXIES": "127.0.0.1",
		"FAREGATE_WEATHER_URL": deadURL(t), "FAREGATE_GEOCODING_URL": deadURL(t), "FAREGATE_AGENT_CONCURRENCY": "16",
	})
	a, b := startServer(t, env), startServer(t, env)
	var ids sync.Map
	codes := hammer(t, 120, func(i int) reply {
		base := a.URL
		if i%2 == 1 {
			base = b.URL
		}
		r := do(t, "POST", base+"/api/tasks", taskBody("Lisbon"), map[string]string{"X-Forwarded-For": fmt.Sprintf("198.51.100.%d", i%100)})
		if id, ok := r.Body["id"].(string); ok {
			ids.Store(id, base)
		}
		return r
	})
	ended := map[string]int{}
	ids.Range(func(k, v any) bool {
		task := waitTask(t, v.(string), k.(string))
		ended[fmt.Sprint(task["status"])]++
		if strings.Contains(fmt.Sprint(task["warnings"]), "budget_exhausted") {
			ended["budget_exhausted"]++
		}
		return true
	})
	ctx := context.Background()
	site, err := be.Client.HGetAll(ctx, "faregate:budget:{"+time.Now().UTC().Format("2006-01-02")+"}:site").Result()
	if err != nil {
		t.Fatal(err)
	}
	var settled, outstanding int64
	fmt.Sscan(site["settled"], &settled)
	fmt.Sscan(site["outstanding"], &outstanding)
	if settled > budget || outstanding != 0 {
		t.Fatalf("site budget %d: settled %d, outstanding %d", budget, settled, outstanding)
	}
	if ended["budget_exhausted"] == 0 {
		t.Fatalf("the budget never stopped a run: %v (raise the load or lower the budget)", ended)
	}
	// Spent out: the next creation, on either replica, is refused before the quota.
	for _, s := range []*server{a, b} {
		if r := do(t, "POST", s.URL+"/api/tasks", taskBody("Lisbon"), map[string]string{"X-Forwarded-For": "192.0.2.1"}); r.Status != 429 || r.code() != "demo_budget_exhausted" {
			t.Fatalf("after the budget was spent: %d %s", r.Status, r.Raw)
		}
	}
	t.Logf("two replicas, site budget %d: settled %d, outstanding %d; creations %v; runs %v", budget, settled, outstanding, codes, ended)
}

// TestEndlessStreamIsCut: a model that never stops streaming is cut at the
// reservation; what is settled equals what was counted; output_truncated.
func TestEndlessStreamIsCut(t *testing.T) {
	be := redistest.Real(t)
	llm := newFakeLLM(t, func(chatRequest, int) fakeReply { return fakeReply{Forever: true} })
	s := startServer(t, realRedisEnv(be.URL, map[string]string{"FAREGATE_LLM_BASE_URL": llm.BaseURL(), "FAREGATE_LLM_MAX_TOKENS": "200"}))
	r := do(t, "POST", s.URL+"/api/tasks", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Rome","days":1}`, nil)
	id := r.Body["id"].(string)
	task := waitTask(t, s.URL, id)
	if !strings.Contains(fmt.Sprint(task["warnings"]), "output_truncated") {
		t.Fatalf("warnings %v lack output_truncated (task %v)", task["warnings"], task["status"])
	}
	usage := task["usage"].(map[string]any)
	prompt, completion := int64(usage["prompt_tokens"].(float64)), int64(usage["completion_tokens"].(float64))
	calls := int64(len(llm.Requests()))
	// Each call is cut once its output reaches max_tokens (200), within one chunk.
	if completion < 200*calls || completion > 210*calls {
		t.Fatalf("completion tokens %d over %d calls: not cut at 200 per call", completion, calls)
	}
	settled, outstanding, _ := budgetHash(t, be.Client, "task:"+id)
	if settled != prompt+completion || outstanding != 0 {
		t.Fatalf("task budget settled %d outstanding %d; usage says %d", settled, outstanding, prompt+completion)
	}
	t.Logf("endless stream: %d calls, completion %d tokens, settled %d = prompt %d + completion %d; server streamed %d bytes",
		calls, completion, settled, prompt, completion, llm.Streamed())
}

// TestBudgetRefusalBeforeQuota: a visitor who cannot afford one minimal run
// is refused with demo_budget_exhausted and the task quota does not move.
// The site's budget is exactly one run (a smaller one refuses to start),
// and one token of it is already spent.
func TestBudgetRefusalBeforeQuota(t *testing.T) {
	be := redistest.Real(t)
	env := realRedisEnv(be.URL, nil)
	need := minRunTokens(t, env)
	s := startServer(t, withEnv(env, "FAREGATE_DAILY_TOKEN_BUDGET", fmt.Sprint(need)))
	if err := be.Client.HIncrBy(context.Background(), "faregate:budget:{"+utcToday()+"}:site", "settled", 1).Err(); err != nil {
		t.Fatal(err)
	}
	r := do(t, "POST", s.URL+"/api/tasks", taskBody("Rome"), nil)
	if r.Status != 429 || r.code() != "demo_budget_exhausted" || r.Header.Get("Retry-After") == "" {
		t.Fatalf("%d %s", r.Status, r.Raw)
	}
	keys, _ := be.Client.Keys(context.Background(), "faregate:quota:*").Result()
	if len(keys) != 0 {
		t.Fatalf("quota moved: %v", keys)
	}
}

// TestBreakerFallbackAndRecovery: a primary that turns slow and then fails
// opens the breaker (the calls of two visitors: one alone never opens it);
// the fallback gets the calls and model_status says degraded; after
// recovery the breaker closes. Without a fallback, new tasks get 503
// model_unavailable and no quota is counted.
func TestBreakerFallbackAndRecovery(t *testing.T) {
	var mode atomic.Value // "slow", "fail", "ok"
	mode.Store("slow")
	primary := newFakeLLM(t, func(req chatRequest, n int) fakeReply {
		switch mode.Load().(string) {
		case "slow":
			rep := fakeReply{Content: itinerary(1, "")}
			rep.Delay = 150 * time.Millisecond
			return rep
		case "fail":
			return fakeReply{Status: 500}
		}
		return fakeReply{Content: itinerary(1, "")}
	})
	fallback := newFakeLLM(t, func(chatRequest, int) fakeReply { return fakeReply{Content: itinerary(1, " (fallback)")} })
	breakerEnv := map[string]string{"FAREGATE_LLM_BASE_URL": primary.BaseURL(), "FAREGATE_BREAKER_WINDOW": "5s",
		"FAREGATE_BREAKER_MIN_CALLS": "3", "FAREGATE_BREAKER_SLOW_CALL": "100ms", "FAREGATE_BREAKER_OPEN_FOR": "700ms",
		"FAREGATE_BREAKER_HALF_OPEN_PROBES": "1", "FAREGATE_IP_DAILY_LIMIT": "100", "FAREGATE_AGENT_MAX_TOOL_CALLS": "0",
		"FAREGATE_TRUSTED_PROXIES": "127.0.0.1",
		// Tasks back to back to trip the breaker, each polled to its end:
		// more than ten requests a second from the poller's address.
		"FAREGATE_REQUESTS_PER_SECOND": "0"}
	// Two visitors take turns (by X-Forwarded-For, from a trusted proxy).
	visitors := []string{"198.51.100.31", "198.51.100.32"}
	create := func(s *server, visitor int) reply {
		return do(t, "POST", s.URL+"/api/tasks", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Rome","days":1}`,
			map[string]string{"X-Forwarded-For": visitors[visitor%2]})
	}

	t.Run("with fallback", func(t *testing.T) {
		env := map[string]string{"FAREGATE_LLM_FALLBACK_BASE_URL": fallback.BaseURL(), "FAREGATE_LLM_FALLBACK_MODEL": "cheap"}
		for k, v := range breakerEnv {
			env[k] = v
		}
		s := startServer(t, env)
		// Slow calls (all succeeding) trip the slow-call ratio.
		for i := 0; i < 3; i++ {
			waitTask(t, s.URL, create(s, i).Body["id"].(string))
		}
		mode.Store("fail")
		cfg := do(t, "GET", s.URL+"/api/config", "", nil)
		if cfg.Body["model_status"] != "degraded" {
			t.Fatalf("model_status %v after slow calls, want degraded", cfg.Body["model_status"])
		}
		before := len(fallback.Requests())
		task := waitTask(t, s.URL, create(s, 0).Body["id"].(string))
		if task["status"] != "succeeded" || len(fallback.Requests()) == before {
			t.Fatalf("while open: task %v, fallback requests %d→%d", task["status"], before, len(fallback.Requests()))
		}
		if res := task["result"].(map[string]any); res["model"] != "cheap" || !strings.Contains(fmt.Sprint(res["warnings"]), "fallback_model") {
			t.Fatalf("result while open: %v", res)
		}
		// Recovery: the primary answers again; after OpenFor a probe closes it.
		mode.Store("ok")
		waitHalfOpen(t, s)
		task = waitTask(t, s.URL, create(s, 1).Body["id"].(string))
		if res := task["result"].(map[string]any); res["model"] != "gpt-3.5-turbo" {
			t.Fatalf("after recovery the task ran on %v", res["model"])
		}
		if st := do(t, "GET", s.URL+"/api/config", "", nil).Body["model_status"]; st != "ok" {
			t.Fatalf("model_status after recovery = %v, want ok", st)
		}
	})

	t.Run("without fallback", func(t *testing.T) {
		mode.Store("fail")
		// The operator hears of both turns on the webhook, signed.
		hook := newAlertReceiver(t, "breaker-secret")
		env := hook.env()
		for k, v := range breakerEnv {
			env[k] = v
		}
		s := startServer(t, env)
		failed := 0
		for i := 0; i < 3; i++ {
			if task := waitTask(t, s.URL, create(s, i).Body["id"].(string)); task["status"] == "failed" {
				failed++
				if code := task["error"].(map[string]any)["code"]; code != "model_unavailable" {
					t.Fatalf("failed task code %v", code)
				}
			}
		}
		if failed != 3 {
			t.Fatalf("%d of 3 tasks failed on a failing model", failed)
		}
		r := create(s, 1)
		if r.Status != 503 || r.code() != "model_unavailable" {
			t.Fatalf("with the breaker open: %d %s", r.Status, r.Raw)
		}
		if st := do(t, "GET", s.URL+"/api/config", "", nil).Body["model_status"]; st != "unavailable" {
			t.Fatalf("model_status = %v", st)
		}
		if a := hook.waitEvent(t, "breaker_open"); !a.Signed || a.Severity != "critical" || a.Details["model"] != "gpt-3.5-turbo" {
			t.Fatalf("breaker_open alert: %+v", a)
		}
		// The refusal counted nothing: the second visitor was admitted
		// once so far, so 98 remain after its next admission.
		mode.Store("ok")
		waitHalfOpen(t, s)
		r = create(s, 1)
		if r.Status != 202 || r.Body["quota"].(map[string]any)["ip_remaining"] != 98.0 {
			t.Fatalf("after recovery: %d %s", r.Status, r.Raw)
		}
		waitTask(t, s.URL, r.Body["id"].(string)) // the probe's success closes the breaker
		if a := hook.waitEvent(t, "breaker_closed"); !a.Signed || a.Severity != "info" {
			t.Fatalf("breaker_closed alert: %+v", a)
		}
	})
}

// waitHalfOpen polls until the primary's breaker has let OpenFor pass and
// is half-open, ready to admit a probe: /api/config asks the breaker its
// state (which is when it moves on from open), /metrics shows the state.
func waitHalfOpen(t *testing.T, s *server) {
	t.Helper()
	deadline := time.After(10 * time.Second)
	// Five looks a second: the /api/config reads count in the visitor's
	// per-second window (10), and the creation that follows must fit.
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	for {
		do(t, "GET", s.URL+"/api/config", "", nil)
		if strings.Contains(string(do(t, "GET", s.URL+"/metrics", "", nil).Raw), `faregate_breaker_state{name="primary",state="half-open"} 1`) {
			return
		}
		select {
		case <-tick.C:
		case <-deadline:
			t.Fatal("the breaker did not become half-open within 10s")
		}
	}
}

// TestServerThatIgnoresStreaming: a server answering stream requests with
// one JSON completion (tool calls included) still drives a run to success.
func TestServerThatIgnoresStreaming(t *testing.T) {
	llm := newFakeLLM(t, func(req chatRequest, n int) fakeReply {
		rep := plannerScript(2)(req, n)
		rep.Plain = true
		return rep
	})
	s := startServer(t, map[string]string{"FAREGATE_LLM_BASE_URL": llm.BaseURL(), "FAREGATE_WEATHER_URL": deadURL(t)})
	r := do(t, "POST", s.URL+"/api/tasks", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Lisbon","days":2}`, nil)
	task := waitTask(t, s.URL, r.Body["id"].(string))
	if task["status"] != "succeeded" || len(llm.Requests()) != 3 {
		t.Fatalf("task %v after %d model calls", task, len(llm.Requests()))
	}
	if u := task["usage"].(map[string]any); u["prompt_tokens"].(float64) != 300 {
		t.Errorf("provider usage not taken: %v", u)
	}
}
