package main

import (
	"bytes"
	"context"
	"encoding/csv"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"faregate/protect/kit/testkit/redistest"
)

// TestOverageChargedRecordedAlerted: a provider that reports usage far
// above what the call reserved (prompt estimate + max_tokens) is charged in
// full: the task's usage shows the reported numbers, the overage is counted
// in faregate_budget_overage_tokens_total, alerted (a signed `overage`
// webhook), written to the ledger that `faregate usage` prints, and the
// principal's next creation is refused because its day's tokens are gone.
func TestOverageChargedRecordedAlerted(t *testing.T) {
	be := redistest.Real(t)
	const prompt, completion = 50000, 30000
	llm := newMeteredLLM(t, func(chatRequest, int) meteredReply {
		return meteredReply{Content: itinerary(2, ""), Prompt: prompt, Completion: completion}
	})
	hook := newAlertReceiver(t, "overage-secret")
	acme := newAPIKey("acme")
	pf := newPolicyFile(t, "tiers:\n  partner: {tasks_per_day: 10, tokens_per_day: 20000, requests_per_minute: 600}\nkeys:\n"+acme.line("partner"))
	s := startServer(t, realRedisEnv(be.URL, mergeEnv(hook.env(), map[string]string{
		"FAREGATE_POLICY_FILE": pf.Path, "FAREGATE_LLM_BASE_URL": llm.BaseURL(), "FAREGATE_AGENT_MAX_TOOL_CALLS": "0",
	})))
	r := do(t, "POST", s.URL+"/api/tasks", `{"destination":"Lisbon","days":2}`, acme.auth())
	if r.Status != 202 {
		t.Fatalf("create: %d %s", r.Status, r.Raw)
	}
	id := r.Body["id"].(string)
	task := waitTask(t, s.URL, id)
	if task["status"] != "succeeded" {
		t.Fatalf("task: %v", task)
	}
	if p, c := usageOf(task); p != prompt || c != completion {
		t.Fatalf("task usage %d+%d, want the reported %d+%d", p, c, prompt, completion)
	}

	// The ledger, as the operator reads it.
	var out bytes.Buffer
	if err := run(context.Background(), []string{"faregate", "usage", "-day", utcToday(), "-by", "principal", "-format", "csv"},
		envOf(map[string]string{"FAREGATE_REDIS_URL": be.URL}), &out); err != nil {
		t.Fatal(err)
	}
	rows, err := csv.NewReader(&out).ReadAll()
	if err != nil || len(rows) < 2 {
		t.Fatalf("usage csv: %v\n%s", err, out.String())
	}
	col := map[string]int{}
	for i, name := range rows[0] {
		col[name] = i
	}
	var row []string
	for _, r := range rows[1:] {
		if r[col["principal"]] == "k_acme" {
			row = r
		}
	}
	if row == nil {
		t.Fatalf("no row for k_acme:\n%s", out.String())
	}
	num := func(name string) int64 {
		n, err := strconv.ParseInt(row[col[name]], 10, 64)
		if err != nil {
			t.Fatalf("column %s: %q", name, row[col[name]])
		}
		return n
	}
	reserved, overage := num("reserved_tokens"), num("overage_tokens")
	if num("calls") != 1 || num("prompt_tokens") != prompt || num("completion_tokens") != completion ||
		reserved <= 0 || reserved >= prompt+completion || overage != prompt+completion-reserved {
		t.Fatalf("ledger row %v: want 1 call of %d+%d tokens with overage = used − reserved", row, prompt, completion)
	}
	if v := metricValue(t, s.URL, `faregate_budget_overage_tokens_total{cause="excess"}`); v != float64(overage) {
		t.Errorf("faregate_budget_overage_tokens_total = %v, want %d", v, overage)
	}
	a := hook.waitEvent(t, "overage")
	if !a.Signed || a.Details["overage_tokens"] != float64(overage) || a.Details["used_tokens"] != float64(prompt+completion) ||
		a.Details["task"] != id || a.Details["principal"] != "k:acme" {
		t.Fatalf("overage alert: %+v", a)
	}

	// The key's day is spent: the next creation is refused before the quota.
	next := do(t, "POST", s.URL+"/api/tasks", `{"destination":"Porto","days":2}`, acme.auth())
	if next.Status != 429 || next.code() != "demo_budget_exhausted" {
		t.Fatalf("after the overage: %d %s", next.Status, next.Raw)
	}
	retryAfterMatches(t, next, "budget")
	if p, ok := rateLimitItem(next.Header.Get("RateLimit-Policy"), "budget"); !ok || p["q"] != 20000 {
		t.Errorf("RateLimit-Policy %q: want the key's 20000 tokens a day", next.Header.Get("RateLimit-Policy"))
	}
	u := do(t, "GET", s.URL+"/api/usage", "", acme.auth())
	if used, left := u.Body["used"].(map[string]any), u.Body["remaining"].(map[string]any); used["tokens"] != float64(prompt+completion) ||
		left["tokens"] != 0.0 || used["tasks"] != 1.0 {
		t.Fatalf("usage after the overage: %s", u.Raw)
	}
	if n := llm.Count(); n != 1 {
		t.Fatalf("model calls %d, want 1", n)
	}
	t.Logf("overage: reserved %d, provider reported %d+%d, overage %d tokens recorded, alerted and in the ledger; next creation %s",
		reserved, prompt, completion, overage, next.code())
}

// TestSpendCap: with prices for the model and a small daily spend limit,
// one task spends past it (the provider reports more than was held) and
// the next creation is refused with demo_budget_exhausted naming the
// "spend" policy. Start-up refuses a spend limit while a model has no
// price, naming FAREGATE_MODEL_PRICES; a price in the policy file is enough.
func TestSpendCap(t *testing.T) {
	llm := newMeteredLLM(t, func(chatRequest, int) meteredReply {
		return meteredReply{Content: itinerary(3, ""), Prompt: 9000, Completion: 1000}
	})
	base := map[string]string{"FAREGATE_LLM_BASE_URL": llm.BaseURL(), "FAREGATE_LLM_MODEL": "test-model",
		"FAREGATE_AGENT_MAX_TOOL_CALLS": "0", "FAREGATE_PLAN_CACHE": "off"}

	t.Run("refusal", func(t *testing.T) {
		// 10 per million tokens: one minimal run (a first call's prompt and
		// max_tokens, under 2,000 tokens) costs under 0.02 and fits under
		// 0.05; the reported 10,000 tokens cost 0.1.
		s := startServer(t, mergeEnv(base, map[string]string{"FAREGATE_MODEL_PRICES": "test-model=10/10",
			"FAREGATE_DAILY_SPEND_LIMIT": "0.05"}))
		task := waitTask(t, s.URL, postTask(t, s.URL, "Rome", nil).Body["id"].(string))
		if task["status"] != "succeeded" {
			t.Fatalf("first task: %v", task)
		}
		r := postTask(t, s.URL, "Oslo", nil)
		if r.Status != 429 || r.code() != "demo_budget_exhausted" {
			t.Fatalf("after the spend: %d %s", r.Status, r.Raw)
		}
		ra := retryAfterMatches(t, r, "spend")
		if p, ok := rateLimitItem(r.Header.Get("RateLimit-Policy"), "spend"); !ok || p["q"] != 50000 || p["w"] != 86400 {
			t.Errorf("RateLimit-Policy %q: want the spend cap in micro-units", r.Header.Get("RateLimit-Policy"))
		}
		if v := metricValue(t, s.URL, `faregate_budget_refusals_total{scope="spend"}`); v < 1 {
			t.Errorf("spend refusals counted: %v", v)
		}
		if v := metricValue(t, s.URL, `faregate_budget_overage_spend_micro_total{cause="excess"}`); v <= 0 {
			t.Errorf("the money spent above the hold was not recorded as overage: %v", v)
		}
		t.Logf("spend cap 0.05: first task spent 0.1; next creation 429 %s (Retry-After %d)", r.code(), ra)
	})

	t.Run("start-up needs prices", func(t *testing.T) {
		for _, prices := range []string{"", "other-model=1/2"} {
			env := mergeEnv(base, map[string]string{"FAREGATE_ADDR": "127.0.0.1:0", "FAREGATE_DAILY_SPEND_LIMIT": "5",
				"FAREGATE_MODEL_PRICES": prices})
			var out bytes.Buffer
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			err := run(ctx, []string{"faregate"}, envOf(env), &out)
			cancel()
			if err == nil || !strings.Contains(err.Error(), "FAREGATE_MODEL_PRICES") || !strings.Contains(err.Error(), "test-model") {
				t.Fatalf("prices %q: run = %v, want a refusal naming FAREGATE_MODEL_PRICES and the model", prices, err)
			}
			if strings.Contains(out.String(), "listening on") {
				t.Fatalf("prices %q: it listened", prices)
			}
		}
		pf := newPolicyFile(t, "models:\n  test-model: {input: 0.15, output: 0.60}\n")
		s := startServer(t, mergeEnv(base, map[string]string{"FAREGATE_DAILY_SPEND_LIMIT": "5", "FAREGATE_POLICY_FILE": pf.Path}))
		if r := postTask(t, s.URL, "Rome", nil); r.Status != 202 {
			t.Fatalf("priced by the policy file: %d %s", r.Status, r.Raw)
		}
	})
}

// TestHangingWebhookNeverSlowsRequests: a webhook that never answers holds
// the alert worker, not the requests or the runs. Two servers share the
// process and the load, one with the hanging webhook and one without; each
// task of both raises an overage alert. Creations alternate between them;
// their p50 latencies (and the runs') stay alike, and the alerts past the
// per-event bound or the worker's bounded queue are shed and counted.
func TestHangingWebhookNeverSlowsRequests(t *testing.T) {
	var hits atomic.Int64
	release := make(chan struct{})
	hanging := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(hanging.Close)
	t.Cleanup(func() { close(release) })
	llm := newMeteredLLM(t, func(chatRequest, int) meteredReply {
		return meteredReply{Content: itinerary(3, ""), Prompt: 4000, Completion: 1000}
	})
	env := map[string]string{"FAREGATE_LLM_BASE_URL": llm.BaseURL(), "FAREGATE_AGENT_MAX_TOOL_CALLS": "0",
		"FAREGATE_IP_DAILY_LIMIT": "100000", "FAREGATE_GLOBAL_DAILY_LIMIT": "100000", "FAREGATE_IP_DAILY_TOKENS": "1000000000",
		"FAREGATE_DAILY_TOKEN_BUDGET": "1000000000", "FAREGATE_QUEUE_MAX": "100000", "FAREGATE_PLAN_CACHE": "off",
		"FAREGATE_LOG_LEVEL": "warn",
		// Creations back to back, timed: more than ten a second from one address.
		"FAREGATE_REQUESTS_PER_SECOND": "0"}
	slow := startServer(t, mergeEnv(env, map[string]string{"FAREGATE_ALERT_WEBHOOK_URL": hanging.URL}))
	quiet := startServer(t, env)

	// More tasks than the alert queue would hold (256) behind the one in flight.
	const n = 280
	lat := map[*server][]time.Duration{}
	ids := map[*server][]string{}
	for i := 0; i < n; i++ {
		for _, s := range []*server{slow, quiet} {
			// Every 20th answer is checked against the OpenAPI document
			// (after the clock stops): the check's CPU is the client's.
			start := time.Now()
			r := leanDo(t, "POST", s.URL+"/api/tasks", taskBody("Rome"), nil, false)
			lat[s] = append(lat[s], time.Since(start))
			checked := []reply{r}
			if i%20 == 0 {
				checked = append(checked, postTask(t, s.URL, "Rome", nil))
			}
			for _, r := range checked {
				if r.Status != 202 {
					t.Fatalf("creation %d: %d %s", i, r.Status, r.Raw)
				}
				ids[s] = append(ids[s], r.Body["id"].(string))
			}
		}
	}
	runs := map[*server][]time.Duration{}
	for _, s := range []*server{slow, quiet} {
		for _, id := range ids[s] {
			task := waitTask(t, s.URL, id)
			if task["status"] != "succeeded" {
				t.Fatalf("task %s: %v", id, task)
			}
			created, _ := time.Parse(time.RFC3339Nano, task["created_at"].(string))
			updated, _ := time.Parse(time.RFC3339Nano, task["updated_at"].(string))
			runs[s] = append(runs[s], updated.Sub(created))
		}
	}
	p50 := func(ds []time.Duration) time.Duration {
		s := slices.Clone(ds)
		slices.Sort(s)
		return s[len(s)/2]
	}
	p95 := func(ds []time.Duration) time.Duration {
		s := slices.Clone(ds)
		slices.Sort(s)
		return s[len(s)*95/100]
	}
	if a, b := p50(lat[slow]), p50(lat[quiet]); a > 2*b+20*time.Millisecond {
		t.Errorf("creation p50 with a hanging webhook %v, without %v", a, b)
	}
	if a, b := p50(runs[slow]), p50(runs[quiet]); a > 2*b+100*time.Millisecond {
		t.Errorf("run p50 with a hanging webhook %v, without %v", a, b)
	}
	if hits.Load() < 1 {
		t.Fatal("the webhook was never called")
	}
	// Past the per-event bound (10 per 10 minutes) they are not even
	// queued; what is queued waits behind the hanging delivery.
	dropped := metricValue(t, slow.URL, `faregate_alerts_total{event="overage",outcome="dropped"}`) +
		metricValue(t, slow.URL, `faregate_alerts_total{event="overage",outcome="limited"}`)
	if dropped < n-10 {
		t.Fatalf("%v overage alerts dropped or limited of %d, want all but the 10 a window sends", dropped, n)
	}
	t.Logf("hanging webhook: creation p50 %v (p95 %v) vs %v (p95 %v) without; run p50 %v vs %v; webhook hit %d times, %v overage alerts dropped or limited",
		p50(lat[slow]).Round(time.Microsecond), p95(lat[slow]).Round(time.Microsecond), p50(lat[quiet]).Round(time.Microsecond),
		p95(lat[quiet]).Round(time.Microsecond), p50(runs[slow]).Round(time.Millisecond), p50(runs[quiet]).Round(time.Millisecond),
		hits.Load(), dropped)
}

// spikeRig is a key whose tasks are planned by a model that, for
// destination Lisbon, first asks for the weather; the forecast API answers
// with days forecast days, so the next call's prompt carries all of them.
type spikeRig struct {
	llm     *meteredLLM
	weather *httptest.Server
	key     apiKey
	policy  *policyFile
}

func newSpikeRig(t *testing.T, days int) *spikeRig {
	rig := &spikeRig{key: newAPIKey("spiky")}
	rig.llm = newMeteredLLM(t, func(req chatRequest, _ int) meteredReply {
		if len(req.Tools) > 0 && req.toolResults() == 0 && strings.Contains(userText(req), "Lisbon") {
			return meteredReply{ToolCalls: []fakeCall{{"weather", `{"location":"Lisbon"}`}}, Prompt: 900, Completion: 20}
		}
		return meteredReply{Content: itinerary(1, ""), Prompt: 900, Completion: 200}
	})
	rig.weather = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Write(forecastJSON(days))
	}))
	t.Cleanup(rig.weather.Close)
	rig.policy = newPolicyFile(t, "tiers:\n  partner: {tasks_per_day: 100, tokens_per_day: 10000000, requests_per_minute: 600}\nkeys:\n"+rig.key.line("partner"))
	return rig
}

func (rig *spikeRig) env() map[string]string {
	return map[string]string{"FAREGATE_POLICY_FILE": rig.policy.Path, "FAREGATE_LLM_BASE_URL": rig.llm.BaseURL(),
		"FAREGATE_WEATHER_URL": rig.weather.URL, "FAREGATE_TASK_TOKEN_LIMIT": "10000000"}
}

// run creates a task for dest on base and waits for its end.
func (rig *spikeRig) run(t *testing.T, base, dest string) map[string]any {
	t.Helper()
	r := do(t, "POST", base+"/api/tasks", `{"destination":"`+dest+`","days":1}`, rig.key.auth())
	if r.Status != 202 {
		t.Fatalf("create %s: %d %s", dest, r.Status, r.Raw)
	}
	return waitTask(t, base, r.Body["id"].(string))
}

// forecastJSON is an Open-Meteo answer with n days of one repeated forecast.
func forecastJSON(n int) []byte {
	var b bytes.Buffer
	cols := []string{"time", "temperature_2m_max", "temperature_2m_min", "precipitation_probability_max", "weather_code"}
	vals := []string{`"2026-12-01"`, "17.5", "9.5", "40", "3"}
	b.WriteString(`{"latitude":38.7,"longitude":-9.1,"daily":{`)
	for c, name := range cols {
		if c > 0 {
			b.WriteByte(',')
		}
		b.WriteString(`"` + name + `":[`)
		for i := 0; i < n; i++ {
			if i > 0 {
				b.WriteByte(',')
			}
			b.WriteString(vals[c])
		}
		b.WriteByte(']')
	}
	b.WriteString("}}")
	return b.Bytes()
}

// TestInputSpikeEndToEnd: a key's first five tasks teach the EMA its usual
// prompt; then a task whose weather tool answers with a huge forecast would
// send a prompt over 10× that: the call is not made, the task fails with
// input_spike and an anomaly alert fires. After three such tasks in the
// hour the key is refused with anomaly_blocked at admission, on both
// replicas: they share the state.
func TestInputSpikeEndToEnd(t *testing.T) {
	be := redistest.Real(t)
	rig := newSpikeRig(t, 2000)
	hook := newAlertReceiver(t, "spike-secret")
	env := realRedisEnv(be.URL, mergeEnv(rig.env(), hook.env()))
	a, b := startServer(t, env), startServer(t, env)
	for i := 0; i < 5; i++ {
		if task := rig.run(t, a.URL, "Porto"); task["status"] != "succeeded" {
			t.Fatalf("warm-up %d: %v", i, task)
		}
	}
	if n := rig.llm.Count(); n != 5 {
		t.Fatalf("warm-up made %d model calls, want 5", n)
	}
	for i, s := range []*server{b, a, b} {
		before := rig.llm.Count()
		task := rig.run(t, s.URL, "Lisbon")
		if task["status"] != "failed" || taskError(task) != "input_spike" {
			t.Fatalf("spike %d: status %v error %v", i+1, task["status"], task["error"])
		}
		// The first call (normal size) asked for the weather; the second,
		// carrying the forecast, was never sent.
		if calls := rig.llm.Count() - before; calls != 1 {
			t.Fatalf("spike %d: the model got %d calls, want 1", i+1, calls)
		}
		steps := task["steps"].([]any)
		last := steps[len(steps)-1].(map[string]any)
		if last["kind"] != "model" || last["status"] != "failed" {
			t.Fatalf("spike %d: last step %v", i+1, last)
		}
	}
	al := hook.waitEvent(t, "anomaly")
	if !al.Signed || al.Details["kind"] != "input_spike" || al.Details["principal"] != "k:spiky" {
		t.Fatalf("anomaly alert: %+v", al)
	}
	ema, prompt := al.Details["ema"].(float64), al.Details["prompt_tokens"].(float64)
	if prompt <= 10*ema {
		t.Fatalf("alerted prompt %v is not over 10× the EMA %v", prompt, ema)
	}
	for _, s := range []*server{a, b} {
		r := do(t, "POST", s.URL+"/api/tasks", `{"destination":"Porto","days":1}`, rig.key.auth())
		if r.Status != 429 || r.code() != "anomaly_blocked" {
			t.Fatalf("after three spikes: %d %s", r.Status, r.Raw)
		}
		if ra, _ := strconv.Atoi(r.Header.Get("Retry-After")); ra < 3000 || ra > 3600 {
			t.Errorf("Retry-After %d, want about an hour", ra)
		}
	}
	t.Logf("input spike: EMA %.0f tokens, spiking prompt %.0f tokens; 3 spikes → anomaly_blocked on both replicas", ema, prompt)
}

// TestPlanCacheModes: in fallback mode (the default) a plan made earlier
// answers the same normalised request once the budget is spent: 202 already
// succeeded, result.cached, no tokens, counted as a task; a different
// request gets 429. In always mode the cache answers first, with the
// budget intact; off never answers.
func TestPlanCacheModes(t *testing.T) {
	llm := newMeteredLLM(t, func(req chatRequest, _ int) meteredReply {
		// Far above a visitor's 40,000 tokens a day: one run spends the day.
		return meteredReply{Content: itinerary(3, ""), Prompt: 30000, Completion: 15000}
	})
	original := `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Lisbon","days":3,"interests":["food","history"]}`
	same := `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"  LISBÕN ","days":3,"interests":["History","FOOD","food"]}`
	other := `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Porto","days":3,"interests":["food","history"]}`
	start := func(t *testing.T, mode string) *server {
		return startServer(t, map[string]string{"FAREGATE_LLM_BASE_URL": llm.BaseURL(), "FAREGATE_AGENT_MAX_TOOL_CALLS": "0",
			"FAREGATE_PLAN_CACHE": mode, "FAREGATE_TASK_TOKEN_LIMIT": "1000000"})
	}
	// planned runs the original request on the model and waits until its
	// plan is in the cache.
	planned := func(t *testing.T, s *server) {
		r := do(t, "POST", s.URL+"/api/tasks", original, nil)
		if task := waitTask(t, s.URL, r.Body["id"].(string)); task["status"] != "succeeded" {
			t.Fatalf("original: %v", task)
		}
		pollUntil(t, 10*time.Second, "plan cached", func() bool {
			return metricValue(t, s.URL, `faregate_plan_cache_total{op="put",outcome="ok"}`) == 1
		})
	}
	cachedTask := func(t *testing.T, s *server, r reply, ipRemaining float64) {
		t.Helper()
		if r.Status != 202 || r.Body["status"] != "succeeded" || r.Body["quota"].(map[string]any)["ip_remaining"] != ipRemaining {
			t.Fatalf("cached answer: %d %s (want 202, succeeded, ip_remaining %v)", r.Status, r.Raw, ipRemaining)
		}
		task := do(t, "GET", s.URL+"/api/tasks/"+r.Body["id"].(string), "", nil).Body
		res, _ := task["result"].(map[string]any)
		if p, c := usageOf(task); task["status"] != "succeeded" || res["cached"] != true || p != 0 || c != 0 || len(res["days"].([]any)) != 3 {
			t.Fatalf("cached task: %v", task)
		}
	}

	t.Run("fallback", func(t *testing.T) {
		s := start(t, "fallback")
		calls := llm.Count()
		planned(t, s)
		r := do(t, "POST", s.URL+"/api/tasks", same, nil)
		cachedTask(t, s, r, 3)
		if r := do(t, "POST", s.URL+"/api/tasks", other, nil); r.Status != 429 || r.code() != "demo_budget_exhausted" {
			t.Fatalf("a different request after the budget: %d %s", r.Status, r.Raw)
		}
		if n := llm.Count() - calls; n != 1 {
			t.Fatalf("%d model calls, want 1", n)
		}
		if v := metricValue(t, s.URL, "faregate_cached_plans_served_total"); v != 1 {
			t.Errorf("cached plans served: %v", v)
		}
	})
	t.Run("fallback, model down", func(t *testing.T) {
		var down atomic.Bool
		flaky := newFakeLLM(t, func(chatRequest, int) fakeReply {
			if down.Load() {
				return fakeReply{Status: 500}
			}
			return fakeReply{Content: itinerary(3, "")}
		})
		s := startServer(t, map[string]string{"FAREGATE_LLM_BASE_URL": flaky.BaseURL(), "FAREGATE_AGENT_MAX_TOOL_CALLS": "0",
			"FAREGATE_PLAN_CACHE": "fallback", "FAREGATE_IP_DAILY_LIMIT": "100",
			"FAREGATE_BREAKER_MIN_CALLS": "3", "FAREGATE_BREAKER_OPEN_FOR": "1h", "FAREGATE_TRUSTED_PROXIES": "127.0.0.1",
			// Failing tasks back to back until the breaker opens, each
			// polled to its end: more than ten requests a second.
			"FAREGATE_REQUESTS_PER_SECOND": "0"})
		planned(t, s)
		down.Store(true)
		// Tasks on the failing model until the breaker opens (a task's
		// retries count too, so it may take fewer than MIN_CALLS tasks),
		// from two visitors by turns: one alone never opens it.
		admitted := 1 // by this visitor, whose ip_remaining is checked below
		for i := 0; ; i++ {
			if i == 10 {
				t.Fatal("the breaker did not open after 10 failing tasks")
			}
			var other map[string]string
			if i%2 == 1 {
				other = map[string]string{"X-Forwarded-For": "198.51.100.40"}
			}
			r := do(t, "POST", s.URL+"/api/tasks", fmt.Sprintf(`{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Town %d","days":3}`, i), other)
			if r.Status == 503 && r.code() == "model_unavailable" {
				break
			}
			if r.Status != 202 {
				t.Fatalf("create: %d %s", r.Status, r.Raw)
			}
			if other == nil {
				admitted++
			}
			if task := waitTask(t, s.URL, r.Body["id"].(string)); task["status"] != "failed" {
				t.Fatalf("a task on a failing model: %v", task)
			}
		}
		if st := do(t, "GET", s.URL+"/api/config", "", nil).Body["model_status"]; st != "unavailable" {
			t.Fatalf("model_status = %v with the breaker open, want unavailable", st)
		}
		calls := flaky.Count()
		// The breaker is open and there is no fallback model: the cached
		// plan is served (counted like any admitted task), anything else is
		// refused uncounted.
		cachedTask(t, s, do(t, "POST", s.URL+"/api/tasks", same, nil), float64(100-admitted-1))
		if r := do(t, "POST", s.URL+"/api/tasks", other, nil); r.Status != 503 || r.code() != "model_unavailable" {
			t.Fatalf("a different request with the model down: %d %s", r.Status, r.Raw)
		}
		if n := flaky.Count() - calls; n != 0 {
			t.Fatalf("%d model calls while the breaker was open", n)
		}
		if v := metricValue(t, s.URL, "faregate_cached_plans_served_total"); v != 1 {
			t.Errorf("cached plans served: %v", v)
		}
	})
	t.Run("always", func(t *testing.T) {
		s := startServer(t, map[string]string{"FAREGATE_LLM_BASE_URL": llm.BaseURL(), "FAREGATE_AGENT_MAX_TOOL_CALLS": "0",
			"FAREGATE_PLAN_CACHE": "always", "FAREGATE_TASK_TOKEN_LIMIT": "1000000", "FAREGATE_TRUSTED_PROXIES": "127.0.0.1"})
		calls := llm.Count()
		planned(t, s)
		// Another visitor, whose budget is untouched, is answered from the cache.
		r := do(t, "POST", s.URL+"/api/tasks", same, map[string]string{"X-Forwarded-For": "198.51.100.20"})
		cachedTask(t, s, r, 4)
		if n := llm.Count() - calls; n != 1 {
			t.Fatalf("%d model calls, want 1: always mode asked the model for a cached plan", n)
		}
	})
	t.Run("off", func(t *testing.T) {
		s := start(t, "off")
		r := do(t, "POST", s.URL+"/api/tasks", original, nil)
		if task := waitTask(t, s.URL, r.Body["id"].(string)); task["status"] != "succeeded" {
			t.Fatalf("original: %v", task)
		}
		if r := do(t, "POST", s.URL+"/api/tasks", same, nil); r.Status != 429 || r.code() != "demo_budget_exhausted" {
			t.Fatalf("same request, cache off: %d %s", r.Status, r.Raw)
		}
		if v := metricValue(t, s.URL, `faregate_plan_cache_total{op="put",outcome="ok"}`); v != 0 {
			t.Errorf("cache off stored %v plans", v)
		}
	})
}
