package main

import (
	"fmt"
	"testing"
	"time"

	"faregate/protect/kit/testkit/redistest"
)

// Policy reloads that must take effect on the very next request (issue 19,
// item 17). Each test waits only for the reload itself (the reload counter,
// which moves once the new policy is wholly in force), never for the
// request to come right: the first request after it must be.

// waitReload rewrites the policy file and waits until the server counts
// one more reload.
func waitReload(t *testing.T, s *server, pf *policyFile, content string) {
	t.Helper()
	before := metricValue(t, s.URL, "faregate_policy_reloads_total")
	pf.write(content)
	pollUntil(t, 5*time.Second, "policy reloaded", func() bool {
		return metricValue(t, s.URL, "faregate_policy_reloads_total") > before
	})
}

// TestPolicyReloadPricesTakeEffect: a model's price in the policy file,
// raised by a reload, is what the next call is charged at. Before the fix
// the prices were read once at start: the reload logged models=1 and the
// next task was charged at the old price.
func TestPolicyReloadPricesTakeEffect(t *testing.T) {
	be := redistest.Real(t)
	const prompt, completion = 1000, 1000
	llm := newMeteredLLM(t, func(chatRequest, int) meteredReply {
		return meteredReply{Content: itinerary(3, ""), Prompt: prompt, Completion: completion}
	})
	priced := func(perM int) string {
		return fmt.Sprintf("models:\n  test-model: {input: %d, output: %d}\n", perM, perM)
	}
	pf := newPolicyFile(t, priced(1))
	s := startServer(t, realRedisEnv(be.URL, map[string]string{
		"FAREGATE_LLM_BASE_URL": llm.BaseURL(), "FAREGATE_LLM_MODEL": "test-model", "FAREGATE_POLICY_FILE": pf.Path,
		"FAREGATE_DAILY_SPEND_LIMIT": "5", "FAREGATE_AGENT_MAX_TOOL_CALLS": "0", "FAREGATE_PLAN_CACHE": "off",
		"FAREGATE_IP_DAILY_LIMIT": "10",
	}))
	spent := func() int64 {
		settled, _, _ := budgetHash(t, be.Client, "spend")
		return settled
	}
	runOne := func(dest string) {
		t.Helper()
		r := postTask(t, s.URL, dest, nil)
		if r.Status != 202 {
			t.Fatalf("%s: %d %s", dest, r.Status, r.Raw)
		}
		if task := waitTask(t, s.URL, r.Body["id"].(string)); task["status"] != "succeeded" {
			t.Fatalf("%s: %v", dest, task)
		}
	}
	// 2,000 tokens at 1 per million tokens: 0.002, 2,000 micro-units.
	runOne("Rome")
	first := spent()
	if first != 2000 {
		t.Fatalf("first task charged %d micro-units, want 2000 (2,000 tokens at 1 per million)", first)
	}
	waitReload(t, s, pf, priced(3))
	runOne("Oslo")
	if second := spent() - first; second != 6000 {
		t.Fatalf("after the price went to 3 per million the next task was charged %d micro-units, want 6000", second)
	}
	t.Logf("reloaded price: first task %d micro-units at 1/M, next task %d at 3/M", first, spent()-first)
}

// TestPolicyReloadRaisedRateLimitTakesEffect: a key refused rate_limited
// (and then refused again from memory) is admitted by the first request
// after a reload that raises its requests_per_minute. Before the fix the
// store had no OnChange: the remembered denial kept answering 429 until
// the window would have freed a slot, about a minute later.
func TestPolicyReloadRaisedRateLimitTakesEffect(t *testing.T) {
	acme := newAPIKey("acme")
	rpm := func(n int) string {
		return fmt.Sprintf("tiers:\n  small: {tasks_per_day: 100, tokens_per_day: 2000000, requests_per_minute: %d}\nkeys:\n", n) +
			acme.line("small")
	}
	pf := newPolicyFile(t, rpm(2))
	s := startServer(t, map[string]string{"FAREGATE_POLICY_FILE": pf.Path,
		"FAREGATE_WEATHER_URL": deadURL(t), "FAREGATE_GEOCODING_URL": deadURL(t)})
	usage := func() reply { return do(t, "GET", s.URL+"/api/usage", "", acme.auth()) }
	for i := 1; i <= 2; i++ {
		if r := usage(); r.Status != 200 {
			t.Fatalf("request %d of 2: %d %s", i, r.Status, r.Raw)
		}
	}
	for i := 0; i < 2; i++ { // the second refusal comes from memory
		if r := usage(); r.Status != 429 || r.code() != "rate_limited" {
			t.Fatalf("over 2 a minute: %d %s", r.Status, r.Raw)
		}
	}
	waitReload(t, s, pf, rpm(100))
	if r := usage(); r.Status != 200 {
		t.Fatalf("the first request after requests_per_minute went from 2 to 100: %d %s", r.Status, r.Raw)
	}
	// And a reload that raises nothing of this key's leaves other keys'
	// denials alone: a second key, refused, stays refused after a reload
	// that only adds a rule.
	other := newAPIKey("other")
	both := func(extra string) string {
		return "tiers:\n  small: {tasks_per_day: 100, tokens_per_day: 2000000, requests_per_minute: 100}\n" +
			"  tiny: {tasks_per_day: 100, tokens_per_day: 2000000, requests_per_minute: 1}\nkeys:\n" +
			acme.line("small") + other.line("tiny") + extra
	}
	waitReload(t, s, pf, both(""))
	if r := do(t, "GET", s.URL+"/api/usage", "", other.auth()); r.Status != 200 {
		t.Fatalf("other key, first request: %d %s", r.Status, r.Raw)
	}
	if r := do(t, "GET", s.URL+"/api/usage", "", other.auth()); r.Status != 429 || r.code() != "rate_limited" {
		t.Fatalf("other key, second request: %d %s", r.Status, r.Raw)
	}
	waitReload(t, s, pf, both("rules:\n  prompt:\n    - {name: no_spam, pattern: 'buy now'}\n"))
	if r := do(t, "GET", s.URL+"/api/usage", "", other.auth()); r.Status != 429 || r.code() != "rate_limited" {
		t.Fatalf("other key after a reload that raised nothing: %d %s", r.Status, r.Raw)
	}
}
