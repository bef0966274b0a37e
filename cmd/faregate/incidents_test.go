package main

import (
	"bytes"
	"context"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/protect/kit/testkit/redistest"
)

// The seed incidents, replayed end to end.

// budgetHash reads one of today's budget scope hashes: settled,
// outstanding, overage. The day's scopes (site, spend, tier:…) are in the
// day's slot, a principal's and its tasks' (p:…, task:…) in its bucket's:
// the one key of the day that ends in key.
func budgetHash(t testing.TB, c *redis.Client, key string) (settled, outstanding, overage int64) {
	t.Helper()
	ctx := context.Background()
	keys, err := c.Keys(ctx, "faregate:budget:{"+utcToday()+"*}:"+key).Result()
	if err != nil || len(keys) > 1 {
		t.Fatalf("budget keys of %s: %v, %v", key, keys, err)
	}
	h := map[string]string{}
	if len(keys) == 1 {
		if h, err = c.HGetAll(ctx, keys[0]).Result(); err != nil {
			t.Fatal(err)
		}
	}
	fmt.Sscan(h["settled"], &settled)
	fmt.Sscan(h["outstanding"], &outstanding)
	fmt.Sscan(h["overage"], &overage)
	return settled, outstanding, overage
}

// ledgerRow is one principal's (or model's) totals from `faregate usage
// -format csv`, by column name.
func ledgerRow(t testing.TB, redisURL, by, name string) map[string]int64 {
	t.Helper()
	var out bytes.Buffer
	if err := run(context.Background(), []string{"faregate", "usage", "-day", utcToday(), "-by", by, "-format", "csv"},
		envOf(map[string]string{"FAREGATE_REDIS_URL": redisURL}), &out); err != nil {
		t.Fatal(err)
	}
	rows, err := csv.NewReader(&out).ReadAll()
	if err != nil {
		t.Fatalf("usage csv: %v\n%s", err, out.String())
	}
	for _, r := range rows[1:] {
		if r[1] != name {
			continue
		}
		m := map[string]int64{}
		for i, col := range rows[0] {
			if n, err := strconv.ParseInt(r[i], 10, 64); err == nil {
				m[col] = n
			}
		}
		return m
	}
	return map[string]int64{}
}

// TestSeed001PromptGrowsThroughToolOutput: a client with a history of
// ordinary calls runs a task whose tool output makes the next prompt about
// 8,000 tokens of one repeated line. The input spike check stops the call
// before it is made; the task costs what its one ordinary call used, no
// more than that call's reservation.
func TestSeed001PromptGrowsThroughToolOutput(t *testing.T) {
	be := redistest.Real(t)
	// 320 identical forecast days: about 8,000 tokens of repeated text.
	rig := newSpikeRig(t, 320)
	s := startServer(t, realRedisEnv(be.URL, rig.env()))
	for i := 0; i < 5; i++ {
		if task := rig.run(t, s.URL, "Porto"); task["status"] != "succeeded" {
			t.Fatalf("ordinary task %d: %v", i, task)
		}
	}
	before := ledgerRow(t, be.URL, "principal", "k_spiky")
	calls := rig.llm.Count()
	task := rig.run(t, s.URL, "Lisbon")
	if task["status"] != "failed" || taskError(task) != "input_spike" {
		t.Fatalf("growing prompt: status %v error %v", task["status"], task["error"])
	}
	if n := rig.llm.Count() - calls; n != 1 {
		t.Fatalf("the model got %d calls for the task, want 1 (the grown prompt must not be sent)", n)
	}
	after := ledgerRow(t, be.URL, "principal", "k_spiky")
	reserved := after["reserved_tokens"] - before["reserved_tokens"]
	spent := after["total_tokens"] - before["total_tokens"]
	settled, outstanding, _ := budgetHash(t, be.Client, "task:"+task["id"].(string))
	p, c := usageOf(task)
	if after["calls"]-before["calls"] != 1 || settled != p+c || spent != settled || outstanding != 0 || settled > reserved {
		t.Fatalf("task cost: settled %d (usage %d+%d, ledger %d), outstanding %d; its one reservation %d",
			settled, p, c, spent, outstanding, reserved)
	}
	if v := metricValue(t, s.URL, `faregate_ratelimit_decisions_total{kind="call",outcome="anomaly"}`); v != 1 {
		t.Errorf("anomalies counted: %v", v)
	}
	t.Logf("seed 001 (prompt growth): grown prompt refused before sending; the task cost %d tokens against one reservation of %d", settled, reserved)
}

// TestSeed001TokenNight replays the night when each request used 6× the
// tokens at 20% more requests. The site's daily budget is sized at three
// ordinary nights (10 tasks of 1,000 tokens); 12 tasks of 6,000 tokens
// arrive. The spend stops within the budget (no overage: every call fitted
// its reservation), every call is on the ledger, later creations are
// refused with demo_budget_exhausted, and the operator hears budget_warning
// and budget_exhausted for the site.
func TestSeed001TokenNight(t *testing.T) {
	be := redistest.Real(t)
	const ordinary, factor, budget = 1000, 6, 3 * 10 * 1000
	llm := newMeteredLLM(t, func(chatRequest, int) meteredReply {
		// A longer answer than usual; max_tokens (8000) covers it.
		return meteredReply{Content: itinerary(3, ""), Prompt: 500, Completion: factor*ordinary - 500}
	})
	hook := newAlertReceiver(t, "night-secret")
	s := startServer(t, realRedisEnv(be.URL, mergeEnv(hook.env(), map[string]string{
		"FAREGATE_LLM_BASE_URL": llm.BaseURL(), "FAREGATE_AGENT_MAX_TOOL_CALLS": "0", "FAREGATE_LLM_MAX_TOKENS": "8000",
		"FAREGATE_DAILY_TOKEN_BUDGET": fmt.Sprint(budget), "FAREGATE_IP_DAILY_TOKENS": "1000000", "FAREGATE_TASK_TOKEN_LIMIT": "1000000",
		"FAREGATE_TRUSTED_PROXIES": "127.0.0.1", "FAREGATE_PLAN_CACHE": "off",
	})))
	codes := map[string]int{}
	for i := 0; i < 12; i++ {
		r := postTask(t, s.URL, "Rome", map[string]string{"X-Forwarded-For": fmt.Sprintf("198.51.100.%d", i+1)})
		key := fmt.Sprint(r.Status, " ", r.code())
		codes[key]++
		if r.Status == 202 {
			if task := waitTask(t, s.URL, r.Body["id"].(string)); task["status"] != "succeeded" {
				t.Fatalf("admitted task %d: %v", i, task)
			}
		} else if r.code() != "demo_budget_exhausted" {
			t.Fatalf("creation %d: %d %s", i, r.Status, r.Raw)
		}
	}
	settled, outstanding, overage := budgetHash(t, be.Client, "site")
	if settled > budget || outstanding != 0 || overage != 0 {
		t.Fatalf("site budget %d: settled %d, outstanding %d, overage %d", budget, settled, outstanding, overage)
	}
	if codes["429 demo_budget_exhausted"] == 0 {
		t.Fatalf("the budget never refused: %v", codes)
	}
	row := ledgerRow(t, be.URL, "model", "gpt-3.5-turbo")
	if row["total_tokens"] != settled || row["calls"] != int64(llm.Count()) {
		t.Fatalf("ledger %v; site settled %d over %d model calls", row, settled, llm.Count())
	}
	warn := hook.waitEvent(t, "budget_warning")
	exhausted := hook.waitEvent(t, "budget_exhausted")
	if warn.Details["scope"] != "site" || exhausted.Details["scope"] != "site" || !warn.Signed || !exhausted.Signed ||
		exhausted.Severity != "critical" {
		t.Fatalf("alerts: warning %+v, exhausted %+v", warn, exhausted)
	}
	t.Logf("seed 001 (6× tokens, +20%% requests): budget %d, settled %d (%d calls on the ledger), creations %v; alerts %v",
		budget, settled, row["calls"], codes, hook.names())
}

// TestSeed003BatchStorm replays a key firing 2,000 creations at once. Its
// tier may use a tenth of the site's daily tokens. The key's spend stays
// within that share, no request gets a 5xx, a visitor's creation in the
// middle of the storm is admitted and planned, and the model's breaker,
// whose calls are all fine, stays closed.
func TestSeed003BatchStorm(t *testing.T) {
	rs := redistest.Start(t) // a private server: the storm floods it
	const site, share = 300000, 0.1
	llm := newMeteredLLM(t, func(req chatRequest, _ int) meteredReply {
		// Like a real provider, it never writes past max_tokens, which a
		// closing call lowers to what the budget has left.
		return meteredReply{Content: itinerary(3, ""), Prompt: 200, Completion: min(800, req.MaxCompletionTokens)}
	})
	batch := newAPIKey("batch")
	pf := newPolicyFile(t, fmt.Sprintf("tiers:\n  bulk: {tasks_per_day: 100, tokens_per_day: 1000000, requests_per_minute: 100000, max_site_share: %v}\nkeys:\n", share)+
		batch.line("bulk"))
	s := startServer(t, realRedisEnv(rs.URL(), map[string]string{
		"FAREGATE_POLICY_FILE": pf.Path, "FAREGATE_LLM_BASE_URL": llm.BaseURL(), "FAREGATE_AGENT_MAX_TOOL_CALLS": "0",
		"FAREGATE_DAILY_TOKEN_BUDGET": fmt.Sprint(site), "FAREGATE_AGENT_CONCURRENCY": "16", "FAREGATE_LOG_LEVEL": "warn",
		"FAREGATE_BREAKER_SLOW_CALL": "5s",
	}))
	const n = 2000
	var answered atomic.Int64
	visitor := make(chan reply, 1)
	var visitorLatency time.Duration
	var once sync.Once
	var ids sync.Map
	stormStart := time.Now()
	codes := hammer(t, n, func(i int) reply {
		// Every 100th answer is checked against the OpenAPI document; the
		// checks cost about 4 ms of CPU each, which would measure the test's
		// client rather than the server on two cores.
		r := leanDo(t, "POST", s.URL+"/api/tasks", `{"destination":"Rome","days":3}`, batch.auth(), i%100 == 0)
		if id, ok := r.Body["id"].(string); ok {
			ids.Store(id, true)
		}
		// Once a tenth of the storm is answered, a visitor asks, while the
		// rest is still in flight.
		if answered.Add(1) == n/10 {
			once.Do(func() {
				go func() {
					start := time.Now()
					v := postTask(t, s.URL, "Lisbon", nil)
					visitorLatency = time.Since(start)
					visitor <- v
				}()
			})
		}
		return r
	})
	storm := time.Since(stormStart)
	v := <-visitor
	if v.Status != 202 {
		t.Fatalf("visitor during the storm: %d %s", v.Status, v.Raw)
	}
	// The storm gets its tasks, refusals, or (when the 2 cores cannot keep
	// up and a Redis call waits past its timeout) the fail-closed 503 with
	// Retry-After; never a 500.
	for k, c := range codes {
		switch {
		case k == "202", strings.HasPrefix(k, "429 "), k == "503 demo_protection_unavailable", k == "503 server_busy":
		default:
			t.Fatalf("storm answers include %s × %d: %v", k, c, codes)
		}
	}
	if codes["202"] > 100 {
		t.Fatalf("%d admitted, over the key's 100 a day", codes["202"])
	}
	ended := map[string]int{}
	ids.Range(func(id, _ any) bool {
		task := waitTask(t, s.URL, id.(string))
		ended[fmt.Sprint(task["status"], " ", taskError(task))]++
		return true
	})
	if task := waitTask(t, s.URL, v.Body["id"].(string)); task["status"] != "succeeded" {
		t.Fatalf("the visitor's task: %v", task)
	}
	c := rs.Client(t)
	tierSettled, tierOut, tierOver := budgetHash(t, c, "tier:bulk")
	siteSettled, siteOut, _ := budgetHash(t, c, "site")
	if limit := int64(share * site); tierSettled > limit || tierOut != 0 || tierOver != 0 {
		t.Fatalf("tier share %d: settled %d, outstanding %d, overage %d", limit, tierSettled, tierOut, tierOver)
	}
	if siteSettled > site || siteOut != 0 || siteSettled <= tierSettled {
		t.Fatalf("site: settled %d, outstanding %d (the key's tier settled %d)", siteSettled, siteOut, tierSettled)
	}
	if st := metricValue(t, s.URL, `faregate_breaker_state{name="primary",state="closed"}`); st != 1 {
		t.Fatalf("the breaker left closed during the storm (closed = %v)", st)
	}
	if cfg := do(t, "GET", s.URL+"/api/config", "", nil); cfg.Body["model_status"] != "ok" {
		t.Fatalf("model_status %v", cfg.Body["model_status"])
	}
	t.Logf("seed 003 (batch storm): %d concurrent keyed creations answered in %v → %v; runs %v; tier settled %d of %d, site %d of %d; "+
		"visitor admitted in %v mid-storm; %d model calls, breaker closed",
		n, storm.Round(time.Millisecond), codes, ended, tierSettled, int64(share*site), siteSettled, site,
		visitorLatency.Round(time.Millisecond), llm.Count())
}

// leanDo is do without the OpenAPI check unless check is set: for floods,
// where the check's CPU would crowd out the server under test.
func leanDo(t testing.TB, method, url, body string, header map[string]string, check bool) reply {
	t.Helper()
	if check {
		return do(t, method, url, body, header)
	}
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	r := reply{Status: resp.StatusCode, Header: resp.Header, Raw: raw}
	_ = json.Unmarshal(raw, &r.Body)
	return r
}
