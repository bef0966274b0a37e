package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// agentBody is what an agent framework sends: the task plus its own
// bookkeeping (tool_call_id, recursion_depth, batch mode).
const agentBody = `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Rome","days":1,
"tool_call_id":"call_abc123","recursion_depth":4,"mode":"batch_process","retry_strategy":{"max_retries":5}}`

// TestAITFEnforceSlowsAgentsNotPeople: in enforce mode an agent-shaped
// body waits in the delay queue before Turnstile, a person's does not; the
// score reaches the client only with server-side debug on. Whether a
// request waited is read from the queue's own record (its decision and
// faregate_aitf_delayed_total), never from a wall clock: on a busy CI
// machine a person's undelayed answer took 179 ms (#19 item 20).
func TestAITFEnforceSlowsAgentsNotPeople(t *testing.T) {
	s := startServer(t, map[string]string{"FAREGATE_AITF_MODE": "enforce", "FAREGATE_AITF_DEBUG": "true", "FAREGATE_IP_DAILY_LIMIT": "50"})
	const delayed = `faregate_aitf_delayed_total{route="/api/tasks"}`
	debug := map[string]string{"X-AITF-Debug": "true"}

	r := do(t, "POST", s.URL+"/api/tasks", taskBody("Rome"), debug)
	if r.Status != 202 {
		t.Fatalf("person: %d %s", r.Status, r.Raw)
	}
	if d := r.Header.Get("X-AITF-Decision"); d != "pass" {
		t.Fatalf("person: decision %q (score %s), want pass: the queue was entered", d, r.Header.Get("X-AITF-Score"))
	}
	if n := metricValue(t, s.URL, delayed); n != 0 {
		t.Fatalf("person: %s is %v, want 0", delayed, n)
	}

	start := time.Now()
	r = do(t, "POST", s.URL+"/api/tasks", agentBody, debug)
	agent := time.Since(start)
	if r.Status != 202 {
		t.Fatalf("agent: %d %s", r.Status, r.Raw)
	}
	// 200 ms + score × 800 ms with a score of at least 0.8: a lower bound
	// only (a timer's), which no busy machine can make fail.
	if agent < 800*time.Millisecond {
		t.Fatalf("agent body waited %v, want at least 200ms + score×800ms", agent)
	}
	if r.Header.Get("X-AITF-Score") == "" || r.Header.Get("X-AITF-Vector") == "" || r.Header.Get("X-AITF-Decision") != "delayed" {
		t.Fatalf("debug headers: %v", r.Header)
	}
	if n := metricValue(t, s.URL, delayed); n != 1 {
		t.Fatalf("agent: %s is %v, want 1", delayed, n)
	}
	// The score travels with the task.
	task := waitTask(t, s.URL, r.Body["id"].(string))
	if task["status"] != "succeeded" {
		t.Fatalf("task: %v", task)
	}
	// A malformed agent body is refused before any wait: the queue's count
	// does not move.
	if r := do(t, "POST", s.URL+"/api/tasks", `{"tool_call_id":"x","recursion_depth":9,"days":"x"}`, nil); r.Status != 400 {
		t.Fatalf("malformed agent body: %d %s", r.Status, r.Raw)
	}
	if n := metricValue(t, s.URL, delayed); n != 1 {
		t.Fatalf("malformed agent body: %s is %v, want it still 1 (it was delayed)", delayed, n)
	}
	t.Logf("agent %v (score %s)", agent.Round(time.Millisecond), r.Header.Get("X-AITF-Score"))
}

// TestAITFScoreNeverLeaksWithoutDebug: without FAREGATE_AITF_DEBUG the
// debug request header gets nothing back.
func TestAITFScoreNeverLeaksWithoutDebug(t *testing.T) {
	s := startServer(t, map[string]string{"FAREGATE_AITF_MODE": "observe"})
	start := time.Now()
	r := do(t, "POST", s.URL+"/api/tasks", agentBody, map[string]string{"X-AITF-Debug": "true"})
	if r.Status != 202 || time.Since(start) > 300*time.Millisecond {
		t.Fatalf("observe mode: %d after %v (observe never delays)", r.Status, time.Since(start))
	}
	for k := range r.Header {
		if strings.HasPrefix(strings.ToLower(k), "x-aitf") {
			t.Fatalf("header %s leaked: %v", k, r.Header)
		}
	}
	// Observe mode counts the would-be delay; it adds no log line per request.
	if strings.Contains(s.Out.String(), "aitf: would delay") {
		t.Fatal("observe mode logged a line for one request")
	}
	metrics := string(do(t, "GET", s.URL+"/metrics", "", nil).Raw)
	if !strings.Contains(metrics, `faregate_aitf_observed_total{route="/api/tasks"} 1`) {
		t.Fatalf("/metrics lacks the observed request:\n%s", grepLines(metrics, "faregate_aitf_observed"))
	}
}

// grepLines returns the lines of text that contain sub, for failure messages.
func grepLines(text, sub string) string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// TestAITFScoreCommand scores NDJSON bodies from a file.
func TestAITFScoreCommand(t *testing.T) {
	f := filepath.Join(t.TempDir(), "bodies.ndjson")
	if err := os.WriteFile(f, []byte(strings.ReplaceAll(agentBody, "\n", "")+"\n"+taskBody("Lisbon")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	if err := run(t.Context(), []string{"faregate", "aitf", "score", f}, envOf(nil), &out); err != nil {
		t.Fatal(err)
	}
	if lines := strings.Count(strings.TrimSpace(out.String()), "\n") + 1; lines < 2 || !strings.Contains(out.String(), "toolcall") {
		t.Fatalf("output:\n%s", out.String())
	}
	// A captured session: twelve requests of one visitor within a second
	// replay as a burst on the last line.
	var session strings.Builder
	for i := range 12 {
		fmt.Fprintf(&session, `{"visitor":"v1","at":"2026-01-01T10:00:00.%03dZ","body":{"q":"lisbon %d"}}`+"\n", i*50, i)
	}
	f = filepath.Join(t.TempDir(), "session.ndjson")
	if err := os.WriteFile(f, []byte(session.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	out.Reset()
	if err := run(t.Context(), []string{"faregate", "aitf", "score", f}, envOf(nil), &out); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 12 || !strings.HasPrefix(lines[11], "score=") || !strings.Contains(lines[11], "burst=1.00") {
		t.Fatalf("session output:\n%s", out.String())
	}
	if err := run(t.Context(), []string{"faregate", "aitf", "frobnicate"}, envOf(nil), &out); err == nil {
		t.Fatal("unknown aitf subcommand accepted")
	}
}
