package main

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/protect/kit/testkit/redistest"
)

// TestRunEmbeddedDefaults is the newcomer's path: run on nothing but
// defaults, say so loudly, and plan a trip with the dummy token.
func TestRunEmbeddedDefaults(t *testing.T) {
	s := startServer(t, map[string]string{"FAREGATE_WEATHER_URL": deadURL(t), "FAREGATE_GEOCODING_URL": deadURL(t)})
	for _, v := range []string{"FAREGATE_REDIS_URL", "FAREGATE_TURNSTILE_SECRET_KEY", "FAREGATE_LLM_BASE_URL"} {
		if !strings.Contains(s.Out.String(), "EMBEDDED DEFAULT ("+v) {
			t.Errorf("start-up does not announce the %s default:\n%s", v, s.Out.String())
		}
	}
	cfg := do(t, "GET", s.URL+"/api/config", "", nil)
	if cfg.Status != 200 || cfg.Body["dev_mode"] != true || cfg.Body["turnstile_test"] != true || cfg.Body["offline_model"] != true ||
		cfg.Body["turnstile_site_key"] != "1x00000000000000000000AA" || cfg.Body["model_status"] != "ok" {
		t.Fatalf("config: %d %s", cfg.Status, cfg.Raw)
	}
	r := do(t, "POST", s.URL+"/api/tasks", taskBody("Lisbon"), nil)
	if r.Status != 202 {
		t.Fatalf("create: %d %s", r.Status, r.Raw)
	}
	q := r.Body["quota"].(map[string]any)
	if r.Body["status"] != "queued" || q["ip_remaining"] != 4.0 || q["global_remaining"] != 99.0 {
		t.Fatalf("202 body: %s", r.Raw)
	}
	if !strings.HasPrefix(r.Header.Get("RateLimit-Policy"), `"daily";q=5;w=86400`) || !strings.Contains(r.Header.Get("RateLimit"), "r=4") {
		t.Errorf("RateLimit headers: %q / %q", r.Header.Get("RateLimit-Policy"), r.Header.Get("RateLimit"))
	}
	if r.Header.Get("X-Request-Id") == "" {
		t.Error("no X-Request-Id")
	}
	task := waitTask(t, s.URL, r.Body["id"].(string))
	if task["status"] != "succeeded" {
		t.Fatalf("task: %v", task)
	}
	res := task["result"].(map[string]any)
	if len(res["days"].([]any)) != 3 || res["offline"] != true {
		t.Fatalf("result: %v", res)
	}
	tools := map[string]bool{}
	for _, st := range task["steps"].([]any) {
		m := st.(map[string]any)
		if m["kind"] == "tool" {
			tools[m["name"].(string)] = true
		}
	}
	if !tools["guide_search"] || !tools["weather"] {
		t.Errorf("offline model did not use guide_search and weather: %v", task["steps"])
	}
	// The weather API is unreachable here: the run degrades, it does not fail.
	if !strings.Contains(fmt.Sprint(res["warnings"]), "weather_unavailable") {
		t.Errorf("warnings %v lack weather_unavailable", res["warnings"])
	}
	do(t, "POST", s.URL+"/api/tasks", `{"destination":"Rome","days":2}`, nil) // one 403 for the denial counter
	metrics := string(do(t, "GET", s.URL+"/metrics", "", nil).Raw)
	for _, want := range []string{
		`faregate_admissions_total{principal="public"} 1`, `faregate_denials_total{code="turnstile_failed"} 1`,
		"faregate_siteverify_duration_seconds_bucket", `faregate_quota_duration_seconds_count{op="take",outcome="allowed"} 1`,
		`faregate_tasks_total{status="succeeded"} 1`, `faregate_llm_tokens_total{kind="prompt",model="offline-demo-planner",source="estimate"}`,
		"faregate_budget_site_remaining_tokens", "faregate_budget_outstanding_reservations", "faregate_aitf_score_bucket",
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}

// deadURL is a loopback URL where nothing listens.
func deadURL(t testing.TB) string {
	srv := httptest.NewServer(http.NotFoundHandler())
	u := srv.URL
	srv.Close()
	return u
}

// TestShapeRefusalsCountNothing sends bad requests; each gets its code and
// none of them moves the quota.
func TestShapeRefusalsCountNothing(t *testing.T) {
	// A table of refused requests back to back from one address: the
	// per-second window and the invalid ratio have tests of their own.
	s := startServer(t, map[string]string{"FAREGATE_IP_DAILY_LIMIT": "2", "FAREGATE_REQUESTS_PER_SECOND": "0", "FAREGATE_INVALID_RATIO": "0"})
	long := strings.Repeat("é", 81)
	cases := []struct {
		name, ctype, body string
		status            int
		code, field       string
	}{
		{"no content type", "", taskBody("Lisbon"), 415, "unsupported_media_type", ""},
		{"form", "application/x-www-form-urlencoded", "a=b", 415, "unsupported_media_type", ""},
		{"text", "text/plain", taskBody("Lisbon"), 415, "unsupported_media_type", ""},
		{"too large", "application/json", `{"destination":"` + strings.Repeat("a", 16400) + `"}`, 413, "request_too_large", ""},
		{"invalid json", "application/json", `{"destination":`, 400, "invalid_request", "body"},
		{"array", "application/json", `[1,2]`, 400, "invalid_request", "body"},
		{"trailing", "application/json", taskBody("Lisbon") + `{}`, 400, "invalid_request", "body"},
		{"days string", "application/json", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Rome","days":"3"}`, 400, "invalid_request", "days"},
		{"days 0", "application/json", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Rome","days":0}`, 400, "invalid_request", "days"},
		{"days 8", "application/json", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Rome","days":8}`, 400, "invalid_request", "days"},
		{"days 2.5", "application/json", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Rome","days":2.5}`, 400, "invalid_request", "days"},
		{"days missing", "application/json", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Rome"}`, 400, "invalid_request", "days"},
		{"empty destination", "application/json", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"   ","days":2}`, 400, "invalid_request", "destination"},
		{"long destination", "application/json", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"` + long + `","days":2}`, 400, "invalid_request", "destination"},
		{"destination number", "application/json", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":5,"days":2}`, 400, "invalid_request", "destination"},
		{"six interests", "application/json", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Rome","days":2,"interests":["a","b","c","d","e","f"]}`, 400, "invalid_request", "interests"},
		{"long interest", "application/json", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Rome","days":2,"interests":["` + strings.Repeat("x", 33) + `"]}`, 400, "invalid_request", "interests"},
		{"empty interest", "application/json", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Rome","days":2,"interests":[""]}`, 400, "invalid_request", "interests"},
		{"interest number", "application/json", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Rome","days":2,"interests":[1]}`, 400, "invalid_request", "interests"},
		{"token number", "application/json", `{"turnstile_token":7,"destination":"Rome","days":2}`, 400, "invalid_request", "turnstile_token"},
		{"missing token", "application/json", `{"destination":"Rome","days":2}`, 403, "turnstile_failed", ""},
		{"wrong token", "application/json", `{"turnstile_token":"nope","destination":"Rome","days":2}`, 403, "turnstile_failed", ""},
		{"token too long", "application/json", `{"turnstile_token":"` + strings.Repeat("X", 2049) + `","destination":"Rome","days":2}`, 403, "turnstile_failed", ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := do(t, "POST", s.URL+"/api/tasks", tc.body, map[string]string{"Content-Type": tc.ctype})
			if r.Status != tc.status || r.code() != tc.code {
				t.Fatalf("got %d %s, want %d %s", r.Status, r.Raw, tc.status, tc.code)
			}
			if rid := r.Header.Get("X-Request-Id"); rid == "" || !strings.Contains(string(r.Raw), `"request_id":"`+rid+`"`) {
				t.Errorf("error body does not repeat X-Request-Id %q: %s", rid, r.Raw)
			}
			if tc.field != "" {
				fields, _ := r.Body["error"].(map[string]any)["fields"].(map[string]any)
				if fields[tc.field] == nil {
					t.Errorf("no message for field %q: %s", tc.field, r.Raw)
				}
			}
		})
	}
	// Unicode within limits is fine, charset parameters too; nothing above was counted.
	r := do(t, "POST", s.URL+"/api/tasks", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"  東京  ","days":1,"interests":["ラーメン"]}`,
		map[string]string{"Content-Type": "application/json; charset=utf-8"})
	if r.Status != 202 || r.Body["quota"].(map[string]any)["ip_remaining"] != 1.0 {
		t.Fatalf("valid unicode request: %d %s (a refused request was counted?)", r.Status, r.Raw)
	}
	task := waitTask(t, s.URL, r.Body["id"].(string))
	if req := task["request"].(map[string]any); req["destination"] != "東京" {
		t.Errorf("destination not trimmed: %v", req)
	}
	// Unknown and malformed task ids are both 404 task_not_found.
	for _, id := range []string{"t_00000000000000000000000000000000", "nope", "t_../../etc"} {
		if r := do(t, "GET", s.URL+"/api/tasks/"+url.PathEscape(id), "", nil); r.Status != 404 || r.code() != "task_not_found" {
			t.Errorf("GET %s: %d %s", id, r.Status, r.Raw)
		}
	}
}

// TestQuotaExactUnderConcurrency: 500 concurrent creations from one visitor
// against a limit of 7 admit exactly 7; 200 visitors (through a trusted
// proxy) against a global limit of 50 admit exactly 50. Real Redis.
func TestQuotaExactUnderConcurrency(t *testing.T) {
	be := redistest.Private(t) // a flood: a redis-server of its own
	t.Run("one visitor", func(t *testing.T) {
		_ = be.Client.FlushDB(context.Background()).Err()
		// 500 creations at once from one address: the daily limit's race,
		// not the per-second window's.
		s := startServer(t, realRedisEnv(be.URL, map[string]string{"FAREGATE_IP_DAILY_LIMIT": "7", "FAREGATE_GLOBAL_DAILY_LIMIT": "100000",
			"FAREGATE_REQUESTS_PER_SECOND": "0"}))
		codes := hammer(t, 500, func(i int) reply {
			return do(t, "POST", s.URL+"/api/tasks", taskBody("Lisbon"), nil)
		})
		if codes["202"] != 7 || codes["429 demo_ip_limit_reached"] != 493 {
			t.Fatalf("codes %v, want exactly 7 accepted and 493 refused", codes)
		}
		t.Logf("one visitor, limit 7, 500 concurrent: %v", codes)
		assertCounter(t, be.Client, "ip:", 7)
	})
	t.Run("many visitors", func(t *testing.T) {
		_ = be.Client.FlushDB(context.Background()).Err()
		s := startServer(t, realRedisEnv(be.URL, map[string]string{"FAREGATE_IP_DAILY_LIMIT": "5", "FAREGATE_GLOBAL_DAILY_LIMIT": "50",
			"FAREGATE_TRUSTED_PROXIES": "127.0.0.1"}))
		codes := hammer(t, 500, func(i int) reply {
			// 200 visitors, documentation-range addresses in a header only.
			xff := fmt.Sprintf("198.51.100.%d", i%200)
			if i%200 >= 100 {
				xff = fmt.Sprintf("203.0.113.%d", i%100)
			}
			return do(t, "POST", s.URL+"/api/tasks", taskBody("Rome"), map[string]string{"X-Forwarded-For": xff})
		})
		if codes["202"] != 50 {
			t.Fatalf("codes %v, want exactly 50 accepted", codes)
		}
		t.Logf("200 visitors, global limit 50, 500 concurrent: %v", codes)
		n, _ := be.Client.Get(context.Background(), globalKeyToday()).Int()
		if n != 50 {
			t.Fatalf("global counter %d, want 50", n)
		}
	})
}

func realRedisEnv(u string, extra map[string]string) map[string]string {
	env := map[string]string{"FAREGATE_REDIS_URL": u, "FAREGATE_IP_HASH_KEY": "test-hash-key-0123456789abcdef"}
	for k, v := range extra {
		env[k] = v
	}
	return env
}

func globalKeyToday() string {
	return "faregate:quota:{" + time.Now().UTC().Format("2006-01-02") + "}:global"
}

// hammer runs n requests concurrently and tallies "status code".
func hammer(t testing.TB, n int, req func(i int) reply) map[string]int {
	t.Helper()
	var mu sync.Mutex
	codes := map[string]int{}
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			<-start
			r := req(i)
			k := fmt.Sprint(r.Status)
			if c := r.code(); c != "" {
				k += " " + c
			}
			mu.Lock()
			codes[k]++
			mu.Unlock()
		}(i)
	}
	close(start)
	wg.Wait()
	return codes
}

// assertCounter checks the one visitor counter of today.
func assertCounter(t testing.TB, c *redis.Client, kind string, want int) {
	t.Helper()
	ctx := context.Background()
	keys, err := c.Keys(ctx, "faregate:quota:*:"+kind+"*").Result()
	if err != nil || len(keys) != 1 {
		t.Fatalf("visitor keys %v %v", keys, err)
	}
	n, _ := c.Get(ctx, keys[0]).Int()
	if n != want {
		t.Fatalf("%s = %d, want %d", keys[0], n, want)
	}
}

// TestFailClosedOnRedisOutage stops the test's own redis-server: creations
// get 503 demo_protection_unavailable and /readyz 503, nothing is launched;
// once it is back, creations work without restarting faregate.
func TestFailClosedOnRedisOutage(t *testing.T) {
	rs := redistest.Start(t)
	s := startServer(t, realRedisEnv(rs.URL(), nil))
	if r := do(t, "GET", s.URL+"/readyz", "", nil); r.Status != 200 {
		t.Fatalf("readyz before: %d", r.Status)
	}
	rs.Stop()
	r := do(t, "POST", s.URL+"/api/tasks", taskBody("Paris"), nil)
	if r.Status != 503 || r.code() != "demo_protection_unavailable" {
		t.Fatalf("with Redis down: %d %s", r.Status, r.Raw)
	}
	if ra := r.Header.Get("Retry-After"); ra == "" || ra > "30" && len(ra) > 1 {
		t.Errorf("Retry-After on 503: %q", ra)
	}
	if r := do(t, "GET", s.URL+"/readyz", "", nil); r.Status != 503 || r.code() != "demo_protection_unavailable" {
		t.Fatalf("readyz with Redis down: %d %s", r.Status, r.Raw)
	}
	if strings.Contains(s.Out.String(), "task admitted") {
		t.Fatal("a task was admitted while Redis was down")
	}
	if err := rs.Start(); err != nil {
		t.Fatal(err)
	}
	// The very next creation works: no stale connection is blamed on the visitor.
	r = do(t, "POST", s.URL+"/api/tasks", taskBody("Paris"), nil)
	if r.Status != 202 {
		t.Fatalf("after Redis came back: %d %s", r.Status, r.Raw)
	}
	if task := waitTask(t, s.URL, r.Body["id"].(string)); task["status"] != "succeeded" {
		t.Fatalf("task after recovery: %v", task)
	}
}

// TestVisitorSpoofing: headers from an untrusted peer change nothing; from a
// trusted proxy they name the visitor; one IPv6 /64 is one visitor.
func TestVisitorSpoofing(t *testing.T) {
	t.Run("untrusted peer", func(t *testing.T) {
		s := startServer(t, map[string]string{"FAREGATE_IP_DAILY_LIMIT": "1"})
		if r := do(t, "POST", s.URL+"/api/tasks", taskBody("Rome"), nil); r.Status != 202 {
			t.Fatalf("first: %d %s", r.Status, r.Raw)
		}
		for _, h := range []map[string]string{
			{"X-Forwarded-For": "198.51.100.1"},
			{"CF-Connecting-IP": "198.51.100.2"},
			{"X-Real-IP": "198.51.100.3", "X-Forwarded-For": "198.51.100.4, 198.51.100.5"},
		} {
			if r := do(t, "POST", s.URL+"/api/tasks", taskBody("Rome"), h); r.Status != 429 || r.code() != "demo_ip_limit_reached" {
				t.Fatalf("spoofed %v: %d %s", h, r.Status, r.Raw)
			}
		}
		if r := do(t, "GET", s.URL+"/healthz", "", map[string]string{"X-Request-Id": "client-chosen"}); r.Header.Get("X-Request-Id") == "client-chosen" {
			t.Error("an untrusted client chose its request id")
		}
	})
	t.Run("trusted proxy", func(t *testing.T) {
		s := startServer(t, map[string]string{"FAREGATE_IP_DAILY_LIMIT": "1", "FAREGATE_TRUSTED_PROXIES": "127.0.0.0/8"})
		for i, xff := range []string{"198.51.100.1", "198.51.100.2", "203.0.113.9, 198.51.100.3"} {
			if r := do(t, "POST", s.URL+"/api/tasks", taskBody("Rome"), map[string]string{"X-Forwarded-For": xff}); r.Status != 202 {
				t.Fatalf("visitor %d (%s): %d %s", i, xff, r.Status, r.Raw)
			}
		}
		// A trusted proxy's request id is kept; a client's is not.
		if r := do(t, "GET", s.URL+"/healthz", "", map[string]string{"X-Request-Id": "edge-42"}); r.Header.Get("X-Request-Id") != "edge-42" {
			t.Errorf("trusted proxy's X-Request-Id replaced: %q", r.Header.Get("X-Request-Id"))
		}
		// The right-most untrusted entry counts: a client-written left part changes nothing.
		if r := do(t, "POST", s.URL+"/api/tasks", taskBody("Rome"), map[string]string{"X-Forwarded-For": "192.0.2.1, 198.51.100.3"}); r.Status != 429 {
			t.Fatalf("prepended spoof: %d %s", r.Status, r.Raw)
		}
	})
	t.Run("ipv6 /64", func(t *testing.T) {
		s := startServer(t, map[string]string{"FAREGATE_IP_DAILY_LIMIT": "1", "FAREGATE_TRUSTED_PROXIES": "127.0.0.1",
			"FAREGATE_CLIENT_IP_HEADER": "CF-Connecting-IP"})
		accepted := 0
		for i := 0; i < 64; i++ {
			ip := fmt.Sprintf("2001:db8:aa:bb:%x::%x", i*977, i+1)
			if r := do(t, "POST", s.URL+"/api/tasks", taskBody("Rome"), map[string]string{"CF-Connecting-IP": ip}); r.Status == 202 {
				accepted++
			} else if r.code() != "demo_ip_limit_reached" {
				t.Fatalf("%s: %d %s", ip, r.Status, r.Raw)
			}
		}
		if accepted != 1 {
			t.Fatalf("64 addresses of one /64 were %d visitors, want 1", accepted)
		}
		if r := do(t, "POST", s.URL+"/api/tasks", taskBody("Rome"), map[string]string{"CF-Connecting-IP": "2001:db8:aa:bc::1"}); r.Status != 202 {
			t.Fatalf("another /64: %d %s", r.Status, r.Raw)
		}
	})
}

// TestNoRawIPAnywhere runs tasks for a visitor behind a trusted proxy and
// then looks for its address in every Redis key and value and every log line.
func TestNoRawIPAnywhere(t *testing.T) {
	be := redistest.Real(t)
	const ip = "198.51.100.77"
	s := startServer(t, realRedisEnv(be.URL, map[string]string{"FAREGATE_TRUSTED_PROXIES": "127.0.0.1", "FAREGATE_LOG_LEVEL": "debug",
		"FAREGATE_AITF_MODE": "observe", "FAREGATE_IP_DAILY_LIMIT": "2"}))
	var ids []string
	for i := 0; i < 3; i++ {
		r := do(t, "POST", s.URL+"/api/tasks", taskBody("Kyoto"), map[string]string{"X-Forwarded-For": ip})
		if id, ok := r.Body["id"].(string); ok {
			ids = append(ids, id)
		}
	}
	if len(ids) != 2 {
		t.Fatalf("created %d tasks, want 2", len(ids))
	}
	for _, id := range ids {
		waitTask(t, s.URL, id)
		if strings.Contains(string(do(t, "GET", s.URL+"/api/tasks/"+id, "", nil).Raw), ip) {
			t.Fatal("task JSON contains the raw IP")
		}
	}
	metrics := do(t, "GET", s.URL+"/metrics", "", nil)
	if strings.Contains(string(metrics.Raw), ip) {
		t.Fatal("metrics contain the raw IP")
	}
	ctx := context.Background()
	keys, err := be.Client.Keys(ctx, "*").Result()
	if err != nil || len(keys) == 0 {
		t.Fatalf("keys: %v %v", keys, err)
	}
	for _, k := range keys {
		if strings.Contains(k, ip) {
			t.Fatalf("key %q contains the raw IP", k)
		}
		dump, err := be.Client.Dump(ctx, k).Result()
		if err != nil {
			t.Fatalf("dump %s: %v", k, err)
		}
		if strings.Contains(dump, ip) {
			t.Fatalf("value of %q contains the raw IP", k)
		}
	}
	if strings.Contains(s.Out.String(), ip) {
		t.Fatalf("a log line contains the raw IP")
	}
}

// TestTurnstileOutcomesThroughTheGate: against a siteverify emulator, each
// outcome maps to its code, and a refused request creates no task and
// counts no quota.
func TestTurnstileOutcomesThroughTheGate(t *testing.T) {
	var answer atomic.Value
	var calls atomic.Int64
	emu := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		a := answer.Load().(string)
		if a == "slow" {
			select {
			case <-time.After(2 * time.Second):
			case <-r.Context().Done():
			}
			return
		}
		if code, ok := strings.CutPrefix(a, "status:"); ok {
			var c int
			fmt.Sscan(code, &c)
			w.WriteHeader(c)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, a)
	}))
	defer emu.Close()
	rs := redistest.Real(t)
	s := startServer(t, realRedisEnv(rs.URL, map[string]string{
		"FAREGATE_TURNSTILE_SECRET_KEY": "test-secret", "FAREGATE_TURNSTILE_HOSTNAMES": "demo.example",
		"FAREGATE_TURNSTILE_VERIFY_URL": emu.URL, "FAREGATE_TURNSTILE_TIMEOUT": "300ms",
		// Every siteverify answer back to back, most of them refusals.
		"FAREGATE_REQUESTS_PER_SECOND": "0", "FAREGATE_INVALID_RATIO": "0",
	}))
	cases := []struct {
		name, answer string
		status       int
		code         string
	}{
		{"wrong hostname", `{"success":true,"hostname":"evil.example"}`, 403, "turnstile_failed"},
		{"invalid response", `{"success":false,"error-codes":["invalid-input-response"]}`, 403, "turnstile_failed"},
		{"replay", `{"success":false,"error-codes":["timeout-or-duplicate"]}`, 403, "turnstile_failed"},
		{"bad secret", `{"success":false,"error-codes":["invalid-input-secret"]}`, 403, "turnstile_failed"},
		{"internal error", `{"success":false,"error-codes":["internal-error"]}`, 503, "demo_protection_unavailable"},
		{"500", "status:500", 503, "demo_protection_unavailable"},
		{"503", "status:503", 503, "demo_protection_unavailable"},
		{"slow", "slow", 503, "demo_protection_unavailable"},
		{"not json", "<html>", 503, "demo_protection_unavailable"},
		{"json array", `[{"success":true}]`, 503, "demo_protection_unavailable"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			answer.Store(tc.answer)
			r := do(t, "POST", s.URL+"/api/tasks", `{"turnstile_token":"tok","destination":"Rome","days":2}`, nil)
			if r.Status != tc.status || r.code() != tc.code {
				t.Fatalf("%d %s, want %d %s", r.Status, r.Raw, tc.status, tc.code)
			}
		})
	}
	// Refusals count in the request window and the failed-check log, and
	// nothing later: no quota, budget or task keys.
	keys, _ := rs.Client.Keys(context.Background(), "faregate:*").Result()
	for _, k := range keys {
		if !strings.HasPrefix(k, "faregate:rl:") && k != "faregate:tasks:{queue}" {
			t.Fatalf("refused requests left keys behind: %v", keys)
		}
	}
	answer.Store(`{"success":true,"hostname":"demo.example"}`)
	if r := do(t, "POST", s.URL+"/api/tasks", `{"turnstile_token":"tok","destination":"Rome","days":2}`, nil); r.Status != 202 {
		t.Fatalf("success: %d %s", r.Status, r.Raw)
	}
	// Connection refused is unavailable too.
	emu.Close()
	if r := do(t, "POST", s.URL+"/api/tasks", `{"turnstile_token":"tok","destination":"Rome","days":2}`, nil); r.Status != 503 {
		t.Fatalf("emulator gone: %d %s", r.Status, r.Raw)
	}
	if calls.Load() == 0 {
		t.Fatal("the emulator was never asked")
	}
}
