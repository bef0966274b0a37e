package main

import (
	"strconv"
	"testing"
	"time"
)

// TestStreamLifetimeEndsAndResumes: the server ends an event stream at
// FAREGATE_STREAM_MAX_DURATION, without done, however long the task runs;
// the client resumes with Last-Event-ID and gets the rest once, ending in
// done. (The page does this by itself: web's browser tests.)
func TestStreamLifetimeEndsAndResumes(t *testing.T) {
	const hold = "Lifetimeville"
	llm, release := heldLLM(t, hold)
	s := startServer(t, map[string]string{"FAREGATE_LLM_BASE_URL": llm.BaseURL(),
		"FAREGATE_STREAM_MAX_DURATION": "1s", "FAREGATE_SHUTDOWN_TIMEOUT": "1s"})
	id := startHeldTask(t, s, llm, hold, nil)
	url := s.URL + "/api/tasks/" + id + "/events"

	start := time.Now()
	first := readSSE(t, url, "", 0) // returns when the server ends the stream
	lasted := time.Since(start)
	if len(first) == 0 {
		t.Fatal("the first stream carried no event before it ended")
	}
	for _, ev := range first {
		if ev.Type == "done" {
			t.Fatalf("the task is held, yet the first stream ended with done: %v", first)
		}
	}
	// Ended by its lifetime, not by the test's 60 s bound on readSSE.
	if lasted < time.Second || lasted > 45*time.Second {
		t.Fatalf("the stream lasted %v with a 1s lifetime", lasted)
	}

	release()
	rest := readSSE(t, url, first[len(first)-1].ID, 0)
	if len(rest) == 0 || rest[len(rest)-1].Type != "done" {
		t.Fatalf("the resumed stream did not end with done: %v", rest)
	}
	seen := map[string]bool{}
	prev := ""
	for _, ev := range append(first, rest...) {
		if seen[ev.ID] {
			t.Fatalf("event %s (%s) sent twice across the resume", ev.ID, ev.Type)
		}
		seen[ev.ID] = true
		if prev != "" && !idAfter(ev.ID, prev) {
			t.Fatalf("event %s came after %s", ev.ID, prev)
		}
		prev = ev.ID
	}
	t.Logf("first stream: %d events in %v; resumed: %d events to done", len(first), lasted.Round(time.Millisecond), len(rest))
}

// idAfter reports whether stream id a comes after b ("ms-seq").
func idAfter(a, b string) bool {
	am, as := splitID(a)
	bm, bs := splitID(b)
	return am > bm || (am == bm && as > bs)
}

func splitID(id string) (ms, seq uint64) {
	for i := 0; i < len(id); i++ {
		if id[i] == '-' {
			ms, _ = strconv.ParseUint(id[:i], 10, 64)
			seq, _ = strconv.ParseUint(id[i+1:], 10, 64)
			return
		}
	}
	ms, _ = strconv.ParseUint(id, 10, 64)
	return
}

// TestQueueBoundRefusesBeforeCounting: with the queue full (one worker,
// FAREGATE_QUEUE_MAX=1, a task running), the next creation gets 503
// server_busy with Retry-After, and neither daily counter moves: the next
// admitted task's remaining counts follow the first's by exactly one.
func TestQueueBoundRefusesBeforeCounting(t *testing.T) {
	const hold = "Queueborough"
	llm, release := heldLLM(t, hold)
	s := startServer(t, map[string]string{"FAREGATE_LLM_BASE_URL": llm.BaseURL(),
		"FAREGATE_QUEUE_MAX": "1", "FAREGATE_AGENT_CONCURRENCY": "1",
		"FAREGATE_IP_DAILY_LIMIT": "10", "FAREGATE_GLOBAL_DAILY_LIMIT": "50", "FAREGATE_SHUTDOWN_TIMEOUT": "1s"})
	first := do(t, "POST", s.URL+"/api/tasks", oneDayBody(hold), nil)
	if first.Status != 202 {
		t.Fatalf("first: %d %s", first.Status, first.Raw)
	}
	q1 := first.Body["quota"].(map[string]any)

	for i := 0; i < 3; i++ {
		r := do(t, "POST", s.URL+"/api/tasks", oneDayBody("Porto"), nil)
		if r.Status != 503 || r.code() != "server_busy" {
			t.Fatalf("creation %d with the queue full: %d %s", i, r.Status, r.Raw)
		}
		if ra, err := strconv.Atoi(r.Header.Get("Retry-After")); err != nil || ra < 1 {
			t.Fatalf("server_busy without a usable Retry-After: %q", r.Header.Get("Retry-After"))
		}
	}

	release()
	waitTask(t, s.URL, first.Body["id"].(string))
	next := do(t, "POST", s.URL+"/api/tasks", oneDayBody("Porto"), nil)
	if next.Status != 202 {
		t.Fatalf("after the queue drained: %d %s", next.Status, next.Raw)
	}
	q2 := next.Body["quota"].(map[string]any)
	for _, k := range []string{"ip_remaining", "global_remaining"} {
		if q1[k].(float64)-q2[k].(float64) != 1 {
			t.Fatalf("%s went %v → %v: the refusals were counted", k, q1[k], q2[k])
		}
	}
}
