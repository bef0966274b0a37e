package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/kit/testkit/redistest"
)

// TestGracefulShutdown: on cancel (SIGINT/SIGTERM in main) faregate stops
// accepting, lets running tasks finish within the grace period, and marks
// those still running after it failed.
func TestGracefulShutdown(t *testing.T) {
	for _, tc := range []struct {
		name, grace, want string
	}{
		{"finishes within grace", "10s", "succeeded"},
		{"marked failed after grace", "200ms", "failed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			be := redistest.Real(t)
			llm := newFakeLLM(t, func(req chatRequest, n int) fakeReply {
				rep := plannerScript(1)(req, n)
				rep.Delay = 400 * time.Millisecond
				return rep
			})
			s := startServer(t, realRedisEnv(be.URL, map[string]string{"FAREGATE_LLM_BASE_URL": llm.BaseURL(),
				"FAREGATE_SHUTDOWN_TIMEOUT": tc.grace, "FAREGATE_WEATHER_URL": deadURL(t)}))
			r := do(t, "POST", s.URL+"/api/tasks", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Rome","days":1}`, nil)
			id := r.Body["id"].(string)
			// Wait until the run is under way, then shut down.
			clocktest.Poll(5*time.Second, func() bool { return len(llm.Requests()) > 0 })
			if err := s.Stop(); err != nil {
				t.Fatalf("run: %v", err)
			}
			raw, err := be.Client.Get(context.Background(), "faregate:task:{"+id+"}").Bytes()
			if err != nil {
				t.Fatal(err)
			}
			var task map[string]any
			if err := json.Unmarshal(raw, &task); err != nil {
				t.Fatal(err)
			}
			if task["status"] != tc.want {
				t.Fatalf("after shutdown the task is %v, want %s", task["status"], tc.want)
			}
			if tc.want == "failed" && !strings.Contains(string(raw), "shut down") {
				t.Fatalf("failure does not say why: %s", raw)
			}
			if _, err := httpGet(s.URL + "/healthz"); err == nil {
				t.Fatal("still accepting after shutdown")
			}
		})
	}
}

// TestUsageCommand prints the ledger written by real runs.
func TestUsageCommand(t *testing.T) {
	be := redistest.Real(t)
	s := startServer(t, realRedisEnv(be.URL, map[string]string{"FAREGATE_WEATHER_URL": deadURL(t)}))
	r := do(t, "POST", s.URL+"/api/tasks", taskBody("Lisbon"), nil)
	waitTask(t, s.URL, r.Body["id"].(string))
	var out bytes.Buffer
	if err := run(t.Context(), []string{"faregate", "usage"}, envOf(map[string]string{"FAREGATE_REDIS_URL": be.URL}), &out); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "offline-demo-planner") {
		t.Fatalf("usage table:\n%s", out.String())
	}
	out.Reset()
	if err := run(t.Context(), []string{"faregate", "usage", "-day", "2001-01-01"}, envOf(map[string]string{"FAREGATE_REDIS_URL": be.URL}), &out); err != nil || !strings.Contains(out.String(), "no model calls") {
		t.Fatalf("empty day: %v\n%s", err, out.String())
	}
	if err := run(t.Context(), []string{"faregate", "usage", "-day", "yesterday"}, envOf(map[string]string{"FAREGATE_REDIS_URL": be.URL}), &out); err == nil {
		t.Fatal("bad -day accepted")
	}
	t.Logf("usage:\n%s", out.String())
}

// TestShutdownDeliversFinalEvents (#19 item 16): a task in a model call
// that outlasts the grace period is marked failed by this replica as it
// shuts down, and a follower on this replica gets that end: the final
// status event (failed) and done, before its stream closes. On a single
// replica with the embedded Redis (TestShutdownFollowerGetsFinalEvents
// does the same on redis-server).
func TestShutdownDeliversFinalEvents(t *testing.T) {
	llm, _ := heldLLM(t, "Oslo")
	s := startServer(t, map[string]string{"FAREGATE_LLM_BASE_URL": llm.BaseURL(),
		"FAREGATE_SHUTDOWN_TIMEOUT": "2s", "FAREGATE_WEATHER_URL": deadURL(t)})
	id := startHeldTask(t, s, llm, "Oslo", nil)
	st, err := openStream(t, s.URL, "/api/tasks/"+id+"/events", nil)
	if err != nil || !st.held() {
		t.Fatalf("open the follower's stream: %v", err)
	}
	defer st.close()
	stopped := make(chan error, 1)
	go func() { stopped <- s.Stop() }()

	// Read the stream to its end (the server closes it when it stops).
	_ = st.conn.SetReadDeadline(time.Now().Add(30 * time.Second))
	var events []sseEvent
	var cur sseEvent
	for {
		line, err := st.events.ReadString('\n')
		if err != nil {
			break
		}
		line = strings.TrimRight(line, "\r\n")
		switch {
		case line == "":
			if cur.Type != "" {
				events = append(events, cur)
			}
			cur = sseEvent{}
		case strings.HasPrefix(line, "event: "):
			cur.Type = line[7:]
		case strings.HasPrefix(line, "data: "):
			cur.Data += line[6:]
		}
	}
	if err := <-stopped; err != nil {
		t.Fatalf("run: %v", err)
	}
	if len(events) < 2 {
		t.Fatalf("the follower's stream ended with %d events, want the final status and done: %+v\n%s", len(events), events, s.Out.String())
	}
	last, status := events[len(events)-1], events[len(events)-2]
	if last.Type != "done" || status.Type != "status" || !strings.Contains(status.Data, `"failed"`) {
		t.Fatalf("the stream's last events are %+v, %+v; want status failed, then done", status, last)
	}
	if !strings.Contains(last.Data, "shut down") {
		t.Fatalf("done does not say why the task failed: %s", last.Data)
	}
}
