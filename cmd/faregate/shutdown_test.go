package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"faregate/protect/redistest"
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
			deadline := time.Now().Add(5 * time.Second)
			for len(llm.Requests()) == 0 && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
			}
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
