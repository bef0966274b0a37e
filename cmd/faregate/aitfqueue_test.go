package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// streamWithBody opens GET path on a connection of its own with a JSON body
// (as an agent framework that sends its bookkeeping everywhere would), and
// returns the connection once the server has taken the stream.
func streamWithBody(t *testing.T, base, path, body string) net.Conn {
	t.Helper()
	conn, err := net.DialTimeout("tcp", hostPort(base), 20*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	req, _ := http.NewRequest("GET", base+path, strings.NewReader(body))
	req.Header.Set("Accept", "text/event-stream")
	req.Header.Set("Content-Type", "application/json")
	_ = conn.SetDeadline(time.Now().Add(60 * time.Second))
	if err := req.Write(conn); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		raw, _ := io.ReadAll(resp.Body)
		t.Fatalf("stream: %d %s", resp.StatusCode, raw)
	}
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "retry:") {
		t.Fatalf("stream preamble %q: %v", line, err)
	}
	_ = conn.SetDeadline(time.Time{})
	return conn
}

// TestAITFStreamDoesNotHoldItsToolCallID (#19 items 9, 10): an event stream
// whose GET carries {"tool_call_id":"call_Z"} held that id for as long as
// it stayed open, so the next request with the id waited out the 25 s
// request deadline in the queue and was then answered 200 with no body.
// The stream's turn ends when it starts: the next request is answered at
// once, in full.
func TestAITFStreamDoesNotHoldItsToolCallID(t *testing.T) {
	llm, release := heldLLM(t, "Oslo")
	s := startServer(t, map[string]string{"FAREGATE_LLM_BASE_URL": llm.BaseURL(), "FAREGATE_AITF_MODE": "enforce", "FAREGATE_IP_DAILY_LIMIT": "50"})
	defer release()
	id := startHeldTask(t, s, llm, "Oslo", nil)
	streamWithBody(t, s.URL, "/api/tasks/"+id+"/events", `{"tool_call_id":"call_Z"}`)

	// Longer than the request deadline, so the old behaviour shows as it was.
	c := &http.Client{Timeout: 40 * time.Second}
	start := time.Now()
	r := doOn(t, c, false, "GET", s.URL+"/api/config", `{"tool_call_id":"call_Z"}`, map[string]string{"X-AITF-Opt-In": "true"})
	took := time.Since(start)
	if r.Status != 200 || r.Body["limits"] == nil {
		t.Fatalf("GET /api/config with the stream's tool_call_id: %d %q after %v", r.Status, r.Raw, took)
	}
	t.Logf("the second request of the stream's id answered %d (%d bytes) after %v", r.Status, len(r.Raw), took.Round(time.Millisecond))
}

// TestAITFOneToolCallIDCannotFillTheQueue (#19 item 9): with one request
// holding call_Z (its Turnstile check hangs) and twenty more of it
// arriving, the queue of ten used to fill with call_Z and another agent's
// request got 503 aitf_queue_full. Now at most eight of one id are in the
// queue, the rest of them are refused (503 aitf_queue_full, Retry-After),
// and the other agent is delayed and answered.
func TestAITFOneToolCallIDCannotFillTheQueue(t *testing.T) {
	hold := make(chan struct{})
	var holdOnce sync.Once
	unhold := func() { holdOnce.Do(func() { close(hold) }) }
	var calls sync.WaitGroup
	var verifies int64
	var mu sync.Mutex
	sv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		verifies++
		mu.Unlock()
		select {
		case <-hold:
		case <-r.Context().Done():
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"success":true,"hostname":"demo.example"}`)
	}))
	t.Cleanup(sv.Close)
	t.Cleanup(unhold)
	s := startServer(t, map[string]string{"FAREGATE_AITF_MODE": "enforce", "FAREGATE_AITF_MAX_QUEUE": "10", "FAREGATE_AITF_DEGRADE_BACKLOG": "10",
		"FAREGATE_TURNSTILE_SECRET_KEY": "test-secret", "FAREGATE_TURNSTILE_HOSTNAMES": "demo.example",
		"FAREGATE_TURNSTILE_VERIFY_URL": sv.URL, "FAREGATE_TURNSTILE_TIMEOUT": "50s", "FAREGATE_IP_DAILY_LIMIT": "50",
		// A flood of creations from one address fills the AITF queue:
		// the per-second window would refuse it first.
		"FAREGATE_REQUESTS_PER_SECOND": "0"})
	defer unhold()
	// However the test ends, its callers (which report through t) end
	// before it does, and before the server stops: the holder is let go,
	// and the queue drains behind it.
	t.Cleanup(func() { unhold(); calls.Wait() })

	optIn := map[string]string{"X-AITF-Opt-In": "true"}
	holder := make(chan reply, 1)
	calls.Add(1)
	go func() {
		defer calls.Done()
		holder <- doOn(t, http.DefaultClient, false, "POST", s.URL+"/api/tasks",
			`{"turnstile_token":"tok","destination":"Rome","days":1,"tool_call_id":"call_Z"}`, optIn)
	}()
	pollUntil(t, 20*time.Second, "the holder's Turnstile check", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return verifies == 1
	})

	const n = 20
	answers := make(chan reply, n)
	for range n {
		calls.Add(1)
		go func() {
			defer calls.Done()
			answers <- doOn(t, &http.Client{Timeout: 60 * time.Second}, false, "GET", s.URL+"/api/config", `{"tool_call_id":"call_Z"}`, optIn)
		}()
	}
	depth := func() float64 { return metricValue(t, s.URL, "faregate_aitf_queue_depth") }
	refused := func() float64 {
		return metricValue(t, s.URL, `faregate_aitf_refused_total{route="/api/config"}`)
	}
	pollUntil(t, 20*time.Second, "every call_Z request queued or refused", func() bool { return depth()+refused() == n })

	agent := doOn(t, http.DefaultClient, false, "GET", s.URL+"/api/config",
		`{"tool_call_id":"call_Y","recursion_depth":4,"mode":"batch_process","retry_strategy":{"max_retries":5}}`, optIn)
	if agent.Status != 200 {
		t.Fatalf("another agent's request beside %v queued and %v refused call_Z: %d %s", depth(), refused(), agent.Status, agent.Raw)
	}
	if d := depth(); d != 7 {
		t.Errorf("call_Z requests in the queue: %v, want 7 (8 with the one running)", d)
	}

	// The ones past the bound were answered at once, with the documented code.
	for range n - 7 {
		r := <-answers
		if r.Status != 503 || r.code() != "aitf_queue_full" || r.Header.Get("Retry-After") == "" {
			t.Errorf("a call_Z past the bound: %d %s Retry-After %q", r.Status, r.Raw, r.Header.Get("Retry-After"))
		}
	}
	unhold()
	calls.Wait()
	close(answers)
	for r := range answers {
		if r.Status != 200 || r.Body["limits"] == nil {
			t.Errorf("a queued call_Z after the holder finished: %d %q", r.Status, r.Raw)
		}
	}
	if r := <-holder; r.Status != 202 {
		t.Errorf("the holder: %d %s", r.Status, r.Raw)
	}
}

// TestAITFAlertFloodCannotDelayOperatorAlerts (#19 item 11): tool_call_ids
// that change every 16 requests raised one signed tool_call_loop webhook
// per id, and with a receiver that hangs on them a policy_reload_failed
// waited behind them all. Now at most ten are raised per window, and the
// operator's alert goes out at once, on its own lane.
func TestAITFAlertFloodCannotDelayOperatorAlerts(t *testing.T) {
	const secret = "alert-secret"
	release := make(chan struct{})
	var mu sync.Mutex
	loops := map[string]bool{} // tool_call_ids alerted (retries count once)
	got := make(chan string, 16)
	hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var p struct {
			Event   string
			Details map[string]any
		}
		_ = json.Unmarshal(body, &p)
		if p.Event == "tool_call_loop" {
			mu.Lock()
			loops[fmt.Sprint(p.Details["tool_call_id"])] = true
			mu.Unlock()
			select { // the receiver hangs on every one of them
			case <-release:
			case <-r.Context().Done():
			}
			return
		}
		select {
		case got <- p.Event:
		default:
		}
	}))
	t.Cleanup(hook.Close)
	pf := newPolicyFile(t, "tiers:\n  partner: {tasks_per_day: 5, tokens_per_day: 2000000, requests_per_minute: 100000}\n")
	s := startServer(t, map[string]string{"FAREGATE_AITF_MODE": "enforce", "FAREGATE_POLICY_FILE": pf.Path,
		"FAREGATE_ALERT_WEBHOOK_URL": hook.URL, "FAREGATE_ALERT_WEBHOOK_SECRET": secret,
		// 480 looping requests at once from one address raise the alert
		// flood: the per-second window would refuse most of them first.
		"FAREGATE_REQUESTS_PER_SECOND": "0"})
	var once sync.Once
	unhang := func() { once.Do(func() { close(release) }) }
	defer unhang() // before the server's shutdown drains the alerts

	const ids, per = 30, 16
	var wg sync.WaitGroup
	for i := range ids {
		wg.Go(func() {
			body := fmt.Sprintf(`{"tool_call_id":"call_%d"}`, i)
			for range per {
				if r := doOn(t, http.DefaultClient, false, "GET", s.URL+"/api/config", body, map[string]string{"X-AITF-Opt-In": "true"}); r.Status != 200 {
					t.Errorf("call_%d: %d %s", i, r.Status, r.Raw)
					return
				}
			}
		})
	}
	wg.Wait()
	if n := metricValue(t, s.URL, `faregate_aitf_tool_call_alerts_total{route="/api/config"}`); n != ids {
		t.Fatalf("tool_call_alerts_total = %v, want %d (one per looping id)", n, ids)
	}

	pf.write("tiers:\n  partner: {tasks_per_day: [oops\n")
	select {
	case ev := <-got:
		if ev != "policy_reload_failed" {
			t.Errorf("first operator alert: %s", ev)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("policy_reload_failed did not arrive within 15 s beside the hanging tool_call_loop alerts")
	}

	// The receiver answers again; shutting down delivers what is queued,
	// so every tool_call_loop alert raised has reached it afterwards.
	unhang()
	if err := s.Stop(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	n := len(loops)
	mu.Unlock()
	if n != 10 {
		t.Errorf("%d tool_call_loop webhooks for %d looping ids, want 10 (the bound per 10 minutes)", n, ids)
	}
	t.Logf("%d looping ids: %d tool_call_loop webhooks; policy_reload_failed delivered beside them", ids, n)
}
