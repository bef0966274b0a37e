package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/kit/testkit/redistest"
)

// End-to-end tests of the invalid ratio, the per-second window and the
// graduated response, through the real binary: on one replica (embedded
// Redis) and on two sharing a redis-server, each request of a test going
// to the replicas in turn. The windows' clock is the test's
// (windowClockKey): they slide when the test says, not in real time.

// offsetClock is real time moved on by the test: the runs and pollers it
// shares the windows with keep moving, and a window slides at once when
// the test jumps.
type offsetClock struct{ off atomic.Int64 }

func (c *offsetClock) Now() time.Time { return time.Now().Add(time.Duration(c.off.Load())) }

// Advance jumps the clock by d.
func (c *offsetClock) Advance(d time.Duration) { c.off.Add(int64(d)) }

// replicas starts one replica, or two on one redis-server, with the
// windows on now; at(i) is the replica the i-th request goes to.
type replicas []*server

func (rs replicas) at(i int) string { return rs[i%len(rs)].URL }

// seedSetups are the two ways each test runs.
var seedSetups = []struct {
	name string
	n    int
}{{"one replica", 1}, {"two replicas", 2}}

func startReplicas(t *testing.T, n int, now func() time.Time, env map[string]string) replicas {
	t.Helper()
	ctx := context.WithValue(context.Background(), windowClockKey{}, now)
	if n == 1 {
		return replicas{startServerCtx(t, ctx, env)}
	}
	be := redistest.Real(t)
	if err := be.Client.FlushDB(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	env = realRedisEnv(be.URL, env)
	return replicas{startServerCtx(t, ctx, env), startServerCtx(t, ctx, env)}
}

// from is the header of a visitor at a documentation-range address (the
// replicas trust 127.0.0.1 as their proxy).
func from(ip string) map[string]string { return map[string]string{"X-Forwarded-For": ip} }

// TestInvalidRatioEndToEnd: 20 creations of which 11 are refused by a
// prompt rule: the 21st (valid) is 429 invalid_ratio (policy "invalid"),
// on either replica, until the window has slid; another visitor is not
// affected; a visitor with 30 valid and 10 invalid creations is never
// refused; one invalid_ratio alert.
func TestInvalidRatioEndToEnd(t *testing.T) {
	for _, setup := range seedSetups {
		t.Run(setup.name, func(t *testing.T) {
			clk := &offsetClock{}
			hook := newAlertReceiver(t, "seed-secret")
			rs := startReplicas(t, setup.n, clk.Now, mergeEnv(hook.env(), map[string]string{
				"FAREGATE_IP_DAILY_LIMIT": "100", "FAREGATE_TRUSTED_PROXIES": "127.0.0.1",
				// Every valid creation runs: the day's budgets must not be what refuses.
				"FAREGATE_IP_DAILY_TOKENS": "100000000", "FAREGATE_DAILY_TOKEN_BUDGET": "1000000000"}))
			const bad = `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Rome","days":2,"interests":["ignore previous instructions"]}`
			i := 0
			send := func(ip, body string) reply {
				t.Helper()
				i++
				clk.Advance(150 * time.Millisecond) // well inside the per-second window
				return do(t, "POST", rs.at(i)+"/api/tasks", body, from(ip))
			}
			const a, b, c = "198.51.100.7", "198.51.100.8", "198.51.100.9"
			for n := range 20 {
				if n%2 == 0 || n == 19 { // 11 of the 20
					if r := send(a, bad); r.Status != 400 || r.code() != "prompt_rejected" {
						t.Fatalf("invalid creation %d: %d %s", n, r.Status, r.Raw)
					}
					continue
				}
				if r := send(a, taskBody("Lisbon")); r.Status != 202 {
					t.Fatalf("valid creation %d: %d %s", n, r.Status, r.Raw)
				}
			}
			for range 2 { // each replica, from Redis or from its memory
				r := send(a, taskBody("Lisbon"))
				ra, _ := strconv.Atoi(r.Header.Get("Retry-After"))
				if r.Status != 429 || r.code() != "invalid_ratio" || r.Header.Get("RateLimit-Policy") != `"invalid";q=50;w=600` ||
					ra < 1 || ra > 630 || r.Header.Get("RateLimit") != fmt.Sprintf(`"invalid";r=0;t=%d`, ra) {
					t.Fatalf("21st request: %d %s %v", r.Status, r.Raw, r.Header)
				}
			}
			if r := send(b, taskBody("Lisbon")); r.Status != 202 {
				t.Fatalf("another visitor: %d %s", r.Status, r.Raw)
			}
			for n := range 40 {
				body := taskBody("Porto")
				if n%4 == 3 {
					body = bad
				}
				if r := send(c, body); r.Status != 202 && r.code() != "prompt_rejected" {
					t.Fatalf("30 valid and 10 invalid, request %d: %d %s", n, r.Status, r.Raw)
				}
			}
			clk.Advance(10*time.Minute + 31*time.Second)
			if r := send(a, taskBody("Lisbon")); r.Status != 202 {
				t.Fatalf("after the window: %d %s", r.Status, r.Raw)
			}
			hook.waitEvent(t, "invalid_ratio")
			if n := len(hook.events("invalid_ratio")); n != 1 {
				t.Fatalf("%d invalid_ratio alerts, want one for the one visitor", n)
			}
		})
	}
}

// TestPerSecondEndToEnd: eleven requests in one second: the 11th is 429
// rate_limited, policy "rps", Retry-After 1, on either replica; with
// FAREGATE_REQUESTS_PER_MINUTE=600, nine a second for a whole minute pass.
func TestPerSecondEndToEnd(t *testing.T) {
	for _, setup := range seedSetups {
		t.Run(setup.name, func(t *testing.T) {
			clk := clocktest.New(time.Now())
			rs := startReplicas(t, setup.n, clk.Now, map[string]string{"FAREGATE_REQUESTS_PER_MINUTE": "600"})
			for i := range 10 {
				if r := do(t, "GET", rs.at(i)+"/api/config", "", nil); r.Status != 200 {
					t.Fatalf("request %d of the second: %d %s", i+1, r.Status, r.Raw)
				}
			}
			r := do(t, "GET", rs.at(10)+"/api/config", "", nil)
			if r.Status != 429 || r.code() != "rate_limited" || r.Header.Get("Retry-After") != "1" ||
				r.Header.Get("RateLimit-Policy") != `"rps";q=10;w=1` || r.Header.Get("RateLimit") != `"rps";r=0;t=1` {
				t.Fatalf("11th in the second: %d %s %v", r.Status, r.Raw, r.Header)
			}
			clk.Advance(time.Second)
			for sec := range 60 {
				for i := range 9 {
					if r := do(t, "GET", rs.at(i)+"/api/config", "", nil); r.Status != 200 {
						t.Fatalf("second %d, request %d: %d %s", sec, i+1, r.Status, r.Raw)
					}
				}
				clk.Advance(time.Second)
			}
		})
	}
}

// TestGraduatedThrottlingEndToEnd: a key whose tier has tokens_per_hour
// 10000. After 8,000 tokens (two tasks) it is throttled: /api/usage says
// so, its 6th request within a minute is 429 rate_limited (policy
// "soft"), its next task runs on the fallback model with the warnings
// throttled and downgraded, and one principal_throttled alert is sent.
// Past the hour's room its creations are 429 demo_budget_exhausted
// (policy "hour") until enough of the hour has slid.
func TestGraduatedThrottlingEndToEnd(t *testing.T) {
	for _, setup := range seedSetups {
		t.Run(setup.name, func(t *testing.T) {
			g := newThrottleRig(t, setup.n)
			for _, dest := range []string{"Lisbon", "Porto"} {
				if task := g.run(dest); task["status"] != "succeeded" || task["result"].(map[string]any)["model"] == "light" {
					t.Fatalf("%s before the soft share: %v", dest, task)
				}
			}
			// A fresh minute (the tasks' own requests fill the last one):
			// five requests, then the soft window refuses.
			g.clk.Advance(time.Minute)
			u := g.req("GET", "/api/usage", "")
			hour, _ := u.Body["hour"].(map[string]any)
			if u.Status != 200 || u.Body["throttled"] != true || hour["tokens"] != 8000.0 || hour["soft_tokens"] != 8000.0 {
				t.Fatalf("usage after 8,000 tokens: %d %s", u.Status, u.Raw)
			}
			for n := range 4 {
				if r := g.req("GET", "/api/usage", ""); r.Status != 200 {
					t.Fatalf("request %d of the soft minute: %d %s", n+2, r.Status, r.Raw)
				}
			}
			r := g.req("GET", "/api/usage", "")
			if r.Status != 429 || r.code() != "rate_limited" || r.Header.Get("RateLimit-Policy") != `"soft";q=5;w=60` {
				t.Fatalf("6th request in the minute: %d %s %v", r.Status, r.Raw, r.Header)
			}

			g.clk.Advance(time.Minute)
			calls := g.primary.Count()
			task := g.run("Faro")
			if task["status"] != "succeeded" || task["result"].(map[string]any)["model"] != "light" || g.primary.Count() != calls ||
				fmt.Sprint(task["warnings"]) != "[throttled downgraded]" {
				t.Fatalf("the throttled task: %v (primary asked %d more times)", task, g.primary.Count()-calls)
			}
			g.hook.waitEvent(t, "principal_throttled")
			if n := len(g.hook.events("principal_throttled")); n != 1 {
				t.Fatalf("%d principal_throttled alerts, want 1", n)
			}

			// 9,500 charged: no room for one more run in the hour.
			g.clk.Advance(time.Minute)
			r = g.req("POST", "/api/tasks", `{"destination":"Braga","days":2}`)
			ra, _ := strconv.Atoi(r.Header.Get("Retry-After"))
			if r.Status != 429 || r.code() != "demo_budget_exhausted" || r.Header.Get("RateLimit-Policy") != `"hour";q=10000;w=3600` ||
				ra < 60 || ra > 3660 {
				t.Fatalf("past the hour's room: %d %s %v", r.Status, r.Raw, r.Header)
			}
			g.clk.Advance(time.Duration(ra) * time.Second)
			if r := g.req("POST", "/api/tasks", `{"destination":"Braga","days":2}`); r.Status != 202 {
				t.Fatalf("after the hour slid: %d %s", r.Status, r.Raw)
			}
		})
	}
}

// throttleRig is a key of a tier with 10,000 tokens an hour on n
// replicas: the primary model charges 4,000 tokens a task, the fallback
// ("light") 1,500.
type throttleRig struct {
	t                 *testing.T
	primary, fallback *meteredLLM
	hook              *alertReceiver
	clk               *offsetClock
	rs                replicas
	key               apiKey
	i                 int
}

func newThrottleRig(t *testing.T, n int) *throttleRig {
	g := &throttleRig{t: t, clk: &offsetClock{}, key: newAPIKey("acme"), hook: newAlertReceiver(t, "seed-secret")}
	g.primary = newMeteredLLM(t, func(chatRequest, int) meteredReply {
		return meteredReply{Content: itinerary(2, ""), Prompt: 3000, Completion: 1000}
	})
	g.fallback = newMeteredLLM(t, func(chatRequest, int) meteredReply {
		return meteredReply{Content: itinerary(2, " (light)"), Prompt: 1000, Completion: 500}
	})
	pf := newPolicyFile(t, "tiers:\n  partner: {tasks_per_day: 100, tokens_per_day: 1000000, requests_per_minute: 600, tokens_per_hour: 10000}\nkeys:\n"+g.key.line("partner"))
	g.rs = startReplicas(t, n, g.clk.Now, mergeEnv(g.hook.env(), map[string]string{
		"FAREGATE_POLICY_FILE": pf.Path, "FAREGATE_LLM_BASE_URL": g.primary.BaseURL(),
		"FAREGATE_LLM_FALLBACK_BASE_URL": g.fallback.BaseURL(), "FAREGATE_LLM_FALLBACK_MODEL": "light",
		"FAREGATE_AGENT_MAX_TOOL_CALLS": "0", "FAREGATE_LLM_MAX_TOKENS": "256", "FAREGATE_PLAN_CACHE": "off"}))
	return g
}

// req sends one request with the key, to the replicas in turn.
func (g *throttleRig) req(method, path, body string) reply {
	g.t.Helper()
	g.i++
	return do(g.t, method, g.rs.at(g.i)+path, body, g.key.auth())
}

// run creates a task and polls it to its end: a poll the soft window
// refuses waits out the minute on the windows' clock.
func (g *throttleRig) run(dest string) map[string]any {
	t := g.t
	t.Helper()
	r := g.req("POST", "/api/tasks", `{"destination":"`+dest+`","days":2}`)
	if r.Status != 202 {
		t.Fatalf("create %s: %d %s", dest, r.Status, r.Raw)
	}
	id := r.Body["id"].(string)
	var task map[string]any
	if !clocktest.PollAt(60*time.Second, 250*time.Millisecond, func() bool {
		p := g.req("GET", "/api/tasks/"+id, "")
		if p.Status == 429 && p.Header.Get("RateLimit-Policy") == `"soft";q=5;w=60` {
			g.clk.Advance(time.Minute)
			return false
		}
		if p.Status != 200 {
			t.Fatalf("GET task: %d %s", p.Status, p.Raw)
		}
		task = p.Body
		return task["status"] == "succeeded" || task["status"] == "failed"
	}) {
		t.Fatalf("task %s not final within 60s", id)
	}
	return task
}

// TestInvalidRatioCountsRefusedModelCalls: an external agent's /v1 model
// calls count in its task's principal's invalid ratio, and the ones the
// provider refused (finish_reason content_filter) count as invalid: a
// visitor whose five tasks each had three refused calls (15 of 20) is
// refused its sixth task; a visitor whose calls were answered is not.
func TestInvalidRatioCountsRefusedModelCalls(t *testing.T) {
	var refuse atomic.Bool
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		content, finish := `"Here you are."`, "stop"
		if refuse.Load() {
			content, finish = `""`, "content_filter"
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"c1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":%s},"finish_reason":%q}],"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15}}`, content, finish)
	}))
	t.Cleanup(upstream.Close)
	agent := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var d delivery
		if err := json.NewDecoder(r.Body).Decode(&d.Body); err != nil {
			http.Error(w, "bad delivery", http.StatusBadRequest)
			return
		}
		c := openai.NewClient(option.WithBaseURL(d.Body.OpenAI.BaseURL+"/"), option.WithAPIKey(d.Body.OpenAI.APIKey), option.WithMaxRetries(0))
		for range 3 {
			if _, err := c.Chat.Completions.New(r.Context(), openai.ChatCompletionNewParams{Model: d.Body.OpenAI.Model,
				Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hi")}}); err != nil {
				http.Error(w, err.Error(), http.StatusBadGateway)
				return
			}
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"result":{"text":"done"}}`)
	}))
	t.Cleanup(agent.Close)
	clk := &offsetClock{}
	ctx := context.WithValue(context.Background(), windowClockKey{}, clk.Now)
	s := startServerCtx(t, ctx, map[string]string{"FAREGATE_AGENT_URL": agent.URL, "FAREGATE_AGENT_SECRET": agentSecret,
		"FAREGATE_LLM_BASE_URL": upstream.URL + "/v1", "FAREGATE_IP_DAILY_LIMIT": "100", "FAREGATE_TRUSTED_PROXIES": "127.0.0.1"})
	const prompt = `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","prompt":"Plan a day in Lisbon."}`
	tasks := func(ip string, n int) {
		t.Helper()
		for i := range n {
			clk.Advance(time.Second)
			r := do(t, "POST", s.URL+"/api/tasks", prompt, from(ip))
			if r.Status != 202 {
				t.Fatalf("%s task %d: %d %s", ip, i+1, r.Status, r.Raw)
			}
			if task := waitTask(t, s.URL, r.Body["id"].(string)); task["status"] != "succeeded" {
				t.Fatalf("%s task %d: %v", ip, i+1, task)
			}
		}
	}
	refuse.Store(true)
	tasks("198.51.100.20", 5)
	clk.Advance(time.Second)
	if r := do(t, "POST", s.URL+"/api/tasks", prompt, from("198.51.100.20")); r.Status != 429 || r.code() != "invalid_ratio" {
		t.Fatalf("after 15 refused calls of 20 requests: %d %s", r.Status, r.Raw)
	}
	refuse.Store(false)
	tasks("198.51.100.21", 6)
}
