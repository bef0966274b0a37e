package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// chatRequest is the part of an OpenAI /chat/completions request the tests check.
type chatRequest struct {
	Model               string           `json:"model"`
	Stream              bool             `json:"stream"`
	MaxTokens           int              `json:"max_tokens"`
	MaxCompletionTokens int              `json:"max_completion_tokens"`
	Messages            []map[string]any `json:"messages"`
	Tools               []struct {
		Function struct {
			Name string `json:"name"`
		} `json:"function"`
	} `json:"tools"`
}

// toolNames lists the tools offered in the request.
func (c chatRequest) toolNames() []string {
	var out []string
	for _, t := range c.Tools {
		out = append(out, t.Function.Name)
	}
	return out
}

// toolResults counts tool messages so far.
func (c chatRequest) toolResults() int {
	n := 0
	for _, m := range c.Messages {
		if m["role"] == "tool" {
			n++
		}
	}
	return n
}

// fakeCall is a tool call the fake model makes.
type fakeCall struct{ Name, Args string }

// fakeReply is what the fake model answers to one request.
type fakeReply struct {
	Status    int           // non-200: an error answer
	Delay     time.Duration // before answering
	Content   string
	ToolCalls []fakeCall
	// Forever streams content chunks until the client goes away.
	Forever bool
	// NoUsage omits the usage chunk.
	NoUsage bool
	// Plain answers with one JSON chat.completion even when asked to stream,
	// as some servers do.
	Plain bool
	// Usage, when set, is the usage reported instead of the derived one.
	Usage *fakeUsage
}

// fakeUsage is the token usage a reply reports.
type fakeUsage struct{ Prompt, Completion int }

// fakeLLM is an OpenAI-compatible server speaking streaming
// /chat/completions, scripted per request.
type fakeLLM struct {
	*httptest.Server
	mu       sync.Mutex
	requests []chatRequest
	script   func(req chatRequest, n int) fakeReply
	// streamed counts content bytes sent in Forever replies.
	streamed int
}

func newFakeLLM(t testing.TB, script func(req chatRequest, n int) fakeReply) *fakeLLM {
	f := &fakeLLM{script: script}
	f.Server = httptest.NewServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.Close)
	return f
}

// BaseURL is what FAREGATE_LLM_BASE_URL should be.
func (f *fakeLLM) BaseURL() string { return f.URL + "/v1" }

func (f *fakeLLM) Requests() []chatRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]chatRequest(nil), f.requests...)
}

// Count is the number of chat requests received.
func (f *fakeLLM) Count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.requests)
}

func (f *fakeLLM) Streamed() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.streamed
}

func (f *fakeLLM) serve(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/v1/chat/completions" {
		http.Error(w, "not found", 404)
		return
	}
	var req chatRequest
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		http.Error(w, "bad json", 400)
		return
	}
	f.mu.Lock()
	f.requests = append(f.requests, req)
	n := len(f.requests)
	f.mu.Unlock()
	rep := f.script(req, n)
	if rep.Delay > 0 {
		select {
		case <-time.After(rep.Delay):
		case <-r.Context().Done():
			return
		}
	}
	if rep.Status != 0 && rep.Status != 200 {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(rep.Status)
		fmt.Fprint(w, `{"error":{"message":"scripted failure","type":"server_error"}}`)
		return
	}
	if !req.Stream || rep.Plain {
		f.answerPlain(w, req, rep)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	fl := w.(http.Flusher)
	send := func(v any) {
		b, _ := json.Marshal(v)
		fmt.Fprintf(w, "data: %s\n\n", b)
		fl.Flush()
	}
	chunk := func(delta map[string]any, finish any) map[string]any {
		return map[string]any{"id": "c1", "object": "chat.completion.chunk", "model": req.Model,
			"choices": []any{map[string]any{"index": 0, "delta": delta, "finish_reason": finish}}}
	}
	if rep.Forever {
		// A chunk a millisecond, as a fast model streams, until the client
		// goes away.
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for i := 0; ; i++ {
			piece := fmt.Sprintf("word%d and more text ", i)
			send(chunk(map[string]any{"content": piece}, nil))
			f.mu.Lock()
			f.streamed += len(piece)
			f.mu.Unlock()
			select {
			case <-r.Context().Done():
				return
			case <-tick.C:
			}
		}
	}
	if len(rep.ToolCalls) > 0 {
		var calls []any
		for i, c := range rep.ToolCalls {
			calls = append(calls, map[string]any{"index": i, "id": fmt.Sprintf("call_%d_%d", n, i), "type": "function",
				"function": map[string]any{"name": c.Name, "arguments": c.Args}})
		}
		send(chunk(map[string]any{"role": "assistant", "tool_calls": calls}, nil))
		send(chunk(map[string]any{}, "tool_calls"))
	} else {
		// Content in small pieces, like a real stream.
		for s := rep.Content; s != ""; {
			k := min(len(s), 12)
			send(chunk(map[string]any{"content": s[:k]}, nil))
			s = s[k:]
		}
		send(chunk(map[string]any{}, "stop"))
	}
	if !rep.NoUsage {
		u := fakeUsage{Prompt: 100 + 10*n, Completion: 20 + len(rep.Content)/4}
		if rep.Usage != nil {
			u = *rep.Usage
		}
		send(map[string]any{"id": "c1", "object": "chat.completion.chunk", "choices": []any{},
			"usage": map[string]any{"prompt_tokens": u.Prompt, "completion_tokens": u.Completion, "total_tokens": u.Prompt + u.Completion}})
	}
	fmt.Fprint(w, "data: [DONE]\n\n")
	fl.Flush()
}

func (f *fakeLLM) answerPlain(w http.ResponseWriter, req chatRequest, rep fakeReply) {
	msg := map[string]any{"role": "assistant", "content": rep.Content}
	if len(rep.ToolCalls) > 0 {
		var calls []any
		for i, c := range rep.ToolCalls {
			calls = append(calls, map[string]any{"id": fmt.Sprintf("call_%d", i), "type": "function",
				"function": map[string]any{"name": c.Name, "arguments": c.Args}})
		}
		msg["tool_calls"] = calls
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{"id": "x", "object": "chat.completion", "model": req.Model,
		"choices": []any{map[string]any{"index": 0, "message": msg, "finish_reason": "stop"}},
		"usage":   map[string]any{"prompt_tokens": 100, "completion_tokens": 50, "total_tokens": 150}})
}

// itinerary is a valid final answer for days days.
func itinerary(days int, extra string) string {
	var parts []string
	for d := 1; d <= days; d++ {
		parts = append(parts, fmt.Sprintf(`{"day":%d,"title":"Day %d%s","items":["Morning walk","Lunch at the market","Evening view"]}`, d, d, extra))
	}
	return `{"summary":"A fine trip.` + extra + `","days":[` + strings.Join(parts, ",") + `]}`
}

// plannerScript is a well-behaved model: guide_search, then weather, then
// the answer.
func plannerScript(days int) func(chatRequest, int) fakeReply {
	return func(req chatRequest, _ int) fakeReply {
		if len(req.Tools) > 0 {
			switch req.toolResults() {
			case 0:
				return fakeReply{ToolCalls: []fakeCall{{"guide_search", `{"query":"Lisbon food"}`}}}
			case 1:
				return fakeReply{ToolCalls: []fakeCall{{"weather", `{"location":"Lisbon"}`}}}
			}
		}
		return fakeReply{Content: itinerary(days, "")}
	}
}
