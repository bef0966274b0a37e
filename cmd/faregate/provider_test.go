package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"

	"faregate/protect/kit/testkit/redistest"
)

// hostileLLM answers every chat request with an itinerary and the usage
// object usage, written as raw JSON (so numbers past 64 bits reach the
// wire as they are).
func hostileLLM(t *testing.T, usage string) *httptest.Server {
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		b, _ := json.Marshal(map[string]any{"id": "h", "object": "chat.completion.chunk",
			"choices": []any{map[string]any{"index": 0, "delta": map[string]any{"content": itinerary(3, "")}, "finish_reason": "stop"}}})
		fmt.Fprintf(w, "data: %s\n\n", b)
		fmt.Fprintf(w, `data: {"id":"h","object":"chat.completion.chunk","choices":[],"usage":%s}`+"\n\n", usage)
		fmt.Fprint(w, "data: [DONE]\n\n")
	}))
	t.Cleanup(s.Close)
	return s
}

// TestOverflowingUsageThroughTheBinary: a provider reporting
// prompt_tokens 9223372036854775807 used to wrap the site's settled tokens
// to −9.2e18, after which every task was admitted. Now each call is
// charged its reservation, and once the site's 5,000 tokens cannot hold
// another run the next task is refused, `faregate usage` totals are what was
// charged (positive, at most the ceiling per call), and the operator hears
// usage_implausible with the raw report.
func TestOverflowingUsageThroughTheBinary(t *testing.T) {
	be := redistest.Real(t)
	const raw = `{"prompt_tokens":9223372036854775807,"completion_tokens":1,"total_tokens":9223372036854775808}`
	llm := hostileLLM(t, raw)
	hook := newAlertReceiver(t, "implausible-secret")
	s := startServer(t, realRedisEnv(be.URL, mergeEnv(hook.env(), map[string]string{
		"FAREGATE_LLM_BASE_URL": llm.URL + "/v1", "FAREGATE_AGENT_MAX_TOOL_CALLS": "0", "FAREGATE_PLAN_CACHE": "off",
		"FAREGATE_DAILY_TOKEN_BUDGET": "5000", "FAREGATE_LLM_MAX_TOKENS": "1024",
	})))
	var charged int64
	var refused reply
	for i := range 4 {
		r := postTask(t, s.URL, fmt.Sprintf("City%c", 'A'+i), nil)
		if r.Status != 202 {
			refused = r
			break
		}
		task := waitTask(t, s.URL, r.Body["id"].(string))
		p, c := usageOf(task)
		if p <= 0 || c <= 0 || p+c > 5000 {
			t.Fatalf("task %d usage %d+%d: want its reservation, positive", i, p, c)
		}
		charged += p + c
	}
	if refused.Status != 429 || refused.code() != "demo_budget_exhausted" {
		t.Fatalf("after %d tokens charged: %d %s; want the site's budget to refuse", charged, refused.Status, refused.Raw)
	}
	a := hook.waitEvent(t, "usage_implausible")
	if a.Details["raw_usage"] != raw || a.Details["model"] == nil {
		t.Fatalf("usage_implausible alert %+v", a)
	}
	var out bytes.Buffer
	if err := run(context.Background(), []string{"faregate", "usage", "-day", utcToday(), "-format", "csv"},
		envOf(map[string]string{"FAREGATE_REDIS_URL": be.URL}), &out); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), fmt.Sprintf(",%d,", charged)) || strings.Contains(out.String(), "-") && strings.Contains(out.String(), ",-") {
		t.Fatalf("faregate usage:\n%s\nwant %d tokens in all, nothing negative", out.String(), charged)
	}
	t.Logf("provider reported %s on every call: %d tokens charged over the admitted tasks, then %s", raw, charged, refused.code())
}

// TestReasoningStreamThroughTheBinary: a reasoning model that streams 65 KB
// reasoning_content chunks for as long as it is read used to grow the
// process by over a gigabyte and be charged 0. Through the binary the call
// is cut at its reservation, charged, and only a bounded part of the
// stream is ever read.
func TestReasoningStreamThroughTheBinary(t *testing.T) {
	var chunks atomic.Int64
	thought, _ := json.Marshal(strings.Repeat("let me think about this ", 65000/24))
	llm := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fl := w.(http.Flusher)
		for {
			if _, err := fmt.Fprintf(w, `data: {"id":"r","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"reasoning_content":%s}}]}`+"\n\n", thought); err != nil {
				return
			}
			fl.Flush()
			if chunks.Add(1) > 20000 { // 1.3 GB: the old failure; stop the test's own upstream
				return
			}
			select {
			case <-r.Context().Done():
				return
			default:
			}
		}
	}))
	t.Cleanup(llm.Close)
	s := startServer(t, map[string]string{"FAREGATE_LLM_BASE_URL": llm.URL + "/v1", "FAREGATE_AGENT_MAX_TOOL_CALLS": "0",
		"FAREGATE_PLAN_CACHE": "off", "FAREGATE_LLM_MAX_TOKENS": "1024"})
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	task := waitTask(t, s.URL, postTask(t, s.URL, "Lisbon", nil).Body["id"].(string))
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	_, completion := usageOf(task)
	// Each call may stream at most its 1,024 output tokens (about 4 KB of
	// ASCII): its first 65 KB chunk reaches the limit and the call is cut.
	// What the upstream got out is more, sitting in the loopback's socket
	// buffers when the connection closed, but far from the 20,000 chunks
	// (1.3 GB) it would stream to a reader that never stops.
	n := chunks.Load()
	if completion <= 0 || n > 1000 {
		t.Fatalf("task %v: %d completion tokens charged after %d reasoning chunks; want the reservation's output charged and the stream cut", task["status"], completion, n)
	}
	t.Logf("task %s (%v): %d completion tokens charged, %d chunks of 65 KB read; heap in use %d MB before, %d MB after",
		task["status"], task["warnings"], completion, n, before.HeapInuse>>20, after.HeapInuse>>20)
}
