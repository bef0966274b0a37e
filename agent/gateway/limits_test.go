package gateway

import (
	"net/http"
	"sync"
	"testing"
	"time"

	"faregate/agent/tasklimits"
	"faregate/protect/kit/testkit/redistest"
)

func limitTask(id string) Task {
	return Task{ID: id, Deadline: time.Now().Add(90 * time.Second), Models: []string{testModel}}
}

// Through the handler, on the task's limits (agent/tasklimits): parallel
// calls past the limit get 429 too_many_calls with Retry-After 1, and an
// embedding call takes a slot in flight like any call; past the call
// limit 429 step_limit, past the embedding limit too, each counted apart;
// a refusal by the governor gives the call back; a Redis that fails
// refuses (fail closed).
func TestHandlerLimits(t *testing.T) {
	b := redistest.Mini(t)
	gate := make(chan struct{})
	var entered sync.WaitGroup
	up := newScripted(t, func(w http.ResponseWriter, r *http.Request, body map[string]any) {
		if body["model"] == testModel && body["input"] == nil {
			entered.Done()
			<-gate
		}
		okAnswer(w)
	})
	e := newEnv(t, up.upstream(), func(o *Options) {
		o.Limits = tasklimits.New(b.Client, tasklimits.Options{Limits: tasklimits.Limits{Calls: 3, Embeddings: 2, Parallel: 2}})
	})
	e.task = limitTask("t_handler")
	body := `{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}`
	embedding := `{"model":"text-embedding-3-small","input":"x"}`
	entered.Add(2)
	results := make(chan int, 2)
	for range 2 {
		go func() {
			r, _ := e.post(t, "/v1/chat/completions", body)
			results <- r.StatusCode
		}()
	}
	entered.Wait()
	for _, path := range []string{"/v1/chat/completions", "/v1/embeddings"} {
		req := body
		if path == "/v1/embeddings" {
			req = embedding
		}
		r, b3 := e.post(t, path, req)
		if code, typ, _ := errorOf(t, b3); r.StatusCode != 429 || code != "too_many_calls" || typ != "rate_limit_error" || r.Header.Get("Retry-After") != "1" {
			t.Fatalf("%s, third in flight: %d %s %s", path, r.StatusCode, b3, r.Header.Get("Retry-After"))
		}
	}
	close(gate)
	for range 2 {
		if s := <-results; s != 200 {
			t.Fatalf("parallel call: %d", s)
		}
	}
	// Embeddings are counted apart from calls.
	for range 2 {
		if r, b := e.post(t, "/v1/embeddings", embedding); r.StatusCode != 200 {
			t.Fatalf("an embedding: %d %s", r.StatusCode, b)
		}
	}
	r, be := e.post(t, "/v1/embeddings", embedding)
	if code, typ, _ := errorOf(t, be); r.StatusCode != 429 || code != "step_limit" || typ != "insufficient_quota" || r.Header.Get("X-Should-Retry") != "false" {
		t.Fatalf("the third embedding: %d %s", r.StatusCode, be)
	}
	// A refusal by the governor gives the call back.
	e.gov.refuse = errBudget
	e.post(t, "/v1/chat/completions", body)
	e.gov.refuse = nil
	entered.Add(1)
	gate = make(chan struct{})
	close(gate)
	if r, b := e.post(t, "/v1/chat/completions", body); r.StatusCode != 200 {
		t.Fatalf("third call: %d %s", r.StatusCode, b)
	}
	r, b4 := e.post(t, "/v1/chat/completions", body)
	if code, typ, _ := errorOf(t, b4); r.StatusCode != 429 || code != "step_limit" || typ != "insufficient_quota" || r.Header.Get("X-Should-Retry") != "false" {
		t.Fatalf("fourth call: %d %s", r.StatusCode, b4)
	}
	b.Mini.SetError("LOADING")
	r, b5 := e.post(t, "/v1/chat/completions", body)
	if code, _, _ := errorOf(t, b5); r.StatusCode != 503 || code != "demo_protection_unavailable" {
		t.Fatalf("Redis down: %d %s", r.StatusCode, b5)
	}
}

func okAnswer(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write([]byte(`{"id":"x","object":"chat.completion","model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}}`))
}
