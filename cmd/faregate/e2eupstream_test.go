package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
)

// e2eUpstream is an OpenAI-compatible provider for the end-to-end tests of
// the model endpoint (issue #21): /v1/chat/completions (JSON and SSE, a
// tool call when the request offers tools and has no tool result yet),
// /v1/responses (JSON and SSE) and /v1/embeddings. Every answer reports
// usage that is exactly what it sent: the prompt tokens a number of its
// own (distinct per request), the output tokens the words it sent. It
// records every request and every usage it reported.
type e2eUpstream struct {
	srv *httptest.Server
	t   testing.TB

	mu       sync.Mutex
	requests []e2eUpRequest
}

// e2eUpRequest is one request the upstream got and what it answered.
type e2eUpRequest struct {
	Path   string
	Body   map[string]any
	Stream bool
	// Prompt and Completion are the usage the answer reported; Usage is
	// false when it reported none (a chat stream not asked for it).
	Prompt, Completion int64
	Usage              bool
	// ToolCall is the id of the tool call answered ("" for text).
	ToolCall string
}

func newE2EUpstream(t testing.TB) *e2eUpstream {
	u := &e2eUpstream{t: t}
	u.srv = httptest.NewServer(http.HandlerFunc(u.serve))
	t.Cleanup(u.srv.Close)
	return u
}

// BaseURL is what FAREGATE_LLM_BASE_URL should be.
func (u *e2eUpstream) BaseURL() string { return u.srv.URL + "/v1" }

// Requests is every request so far, in arrival order.
func (u *e2eUpstream) Requests() []e2eUpRequest {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]e2eUpRequest(nil), u.requests...)
}

// e2eWords is what the upstream answers, in words (one output token each).
func e2eWords(n int, kind string) []string {
	words := make([]string, 0, 3+n%4)
	for i := range cap(words) {
		words = append(words, fmt.Sprintf("%s%d.%d ", kind, n, i))
	}
	return words
}

func (u *e2eUpstream) serve(w http.ResponseWriter, r *http.Request) {
	raw, _ := io.ReadAll(r.Body)
	var body map[string]any
	if r.Method != http.MethodPost || json.Unmarshal(raw, &body) != nil {
		http.Error(w, `{"error":{"message":"bad request","type":"invalid_request_error"}}`, http.StatusBadRequest)
		return
	}
	stream, _ := body["stream"].(bool)
	u.mu.Lock()
	n := len(u.requests) + 1
	u.requests = append(u.requests, e2eUpRequest{Path: r.URL.Path, Body: body, Stream: stream})
	u.mu.Unlock()
	// The usage of this answer: a prompt count of the upstream's own,
	// distinct per request, and one output token per word sent.
	rec := e2eUpRequest{Prompt: int64(40 + 3*n), Usage: true}
	model, _ := body["model"].(string)
	switch r.URL.Path {
	case "/v1/chat/completions":
		u.chat(w, body, model, n, stream, &rec)
	case "/v1/responses":
		u.responses(w, model, n, stream, &rec)
	case "/v1/embeddings":
		u.embeddings(w, body, model, &rec)
	default:
		http.Error(w, "not found", http.StatusNotFound)
		rec.Usage = false
	}
	u.mu.Lock()
	q := &u.requests[n-1]
	q.Prompt, q.Completion, q.Usage, q.ToolCall = rec.Prompt, rec.Completion, rec.Usage, rec.ToolCall
	u.mu.Unlock()
}

// wantsTool: the request offers tools and carries no tool result yet.
func wantsTool(body map[string]any) bool {
	tools, _ := body["tools"].([]any)
	if len(tools) == 0 {
		return false
	}
	msgs, _ := body["messages"].([]any)
	for _, m := range msgs {
		if mm, _ := m.(map[string]any); mm["role"] == "tool" {
			return false
		}
	}
	return true
}

func e2eUsage(rec *e2eUpRequest) map[string]any {
	return map[string]any{"prompt_tokens": rec.Prompt, "completion_tokens": rec.Completion,
		"total_tokens": rec.Prompt + rec.Completion}
}

func (u *e2eUpstream) chat(w http.ResponseWriter, body map[string]any, model string, n int, stream bool, rec *e2eUpRequest) {
	tool := wantsTool(body)
	words := e2eWords(n, "chat")
	args := []string{`{"city":`, `"Lisbon"}`}
	if tool {
		rec.ToolCall = fmt.Sprintf("call_e2e_%d", n)
		// The arguments' pieces are the output the tool call sent.
		rec.Completion = int64(len(args))
	} else {
		rec.Completion = int64(len(words))
	}
	if !stream {
		msg := map[string]any{"role": "assistant", "content": strings.Join(words, ""), "refusal": nil}
		finish := "stop"
		if tool {
			msg["content"] = nil
			msg["tool_calls"] = []any{map[string]any{"id": rec.ToolCall, "type": "function",
				"function": map[string]any{"name": "lookup", "arguments": strings.Join(args, "")}}}
			finish = "tool_calls"
		}
		writeE2EJSON(w, map[string]any{"id": fmt.Sprintf("chatcmpl-%d", n), "object": "chat.completion", "created": 1700000000,
			"model": model, "choices": []any{map[string]any{"index": 0, "message": msg, "finish_reason": finish, "logprobs": nil}},
			"usage": e2eUsage(rec)})
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	fl := w.(http.Flusher)
	send := func(v any) {
		b, _ := json.Marshal(v)
		fmt.Fprintf(w, "data: %s\n\n", b)
		fl.Flush()
	}
	id := fmt.Sprintf("chatcmpl-%d", n)
	chunk := func(delta map[string]any, finish any) map[string]any {
		return map[string]any{"id": id, "object": "chat.completion.chunk", "created": 1700000000, "model": model,
			"choices": []any{map[string]any{"index": 0, "delta": delta, "finish_reason": finish}}}
	}
	if tool {
		send(chunk(map[string]any{"role": "assistant", "tool_calls": []any{map[string]any{"index": 0, "id": rec.ToolCall,
			"type": "function", "function": map[string]any{"name": "lookup", "arguments": args[0]}}}}, nil))
		send(chunk(map[string]any{"tool_calls": []any{map[string]any{"index": 0, "function": map[string]any{"arguments": args[1]}}}}, nil))
		send(chunk(map[string]any{}, "tool_calls"))
	} else {
		send(chunk(map[string]any{"role": "assistant", "content": ""}, nil))
		for _, wd := range words {
			send(chunk(map[string]any{"content": wd}, nil))
		}
		send(chunk(map[string]any{}, "stop"))
	}
	so, _ := body["stream_options"].(map[string]any)
	if so["include_usage"] == true {
		send(map[string]any{"id": id, "object": "chat.completion.chunk", "created": 1700000000, "model": model,
			"choices": []any{}, "usage": e2eUsage(rec)})
	} else {
		rec.Usage = false
	}
	fmt.Fprint(w, "data: [DONE]\n\n")
	fl.Flush()
}

func (u *e2eUpstream) responses(w http.ResponseWriter, model string, n int, stream bool, rec *e2eUpRequest) {
	words := e2eWords(n, "resp")
	rec.Completion = int64(len(words))
	id, msgID := fmt.Sprintf("resp_e2e_%d", n), fmt.Sprintf("msg_e2e_%d", n)
	usage := map[string]any{"input_tokens": rec.Prompt, "output_tokens": rec.Completion, "total_tokens": rec.Prompt + rec.Completion,
		"input_tokens_details": map[string]any{"cached_tokens": 0}, "output_tokens_details": map[string]any{"reasoning_tokens": 0}}
	text := strings.Join(words, "")
	part := func(t string) map[string]any {
		return map[string]any{"type": "output_text", "text": t, "annotations": []any{}}
	}
	item := func(status string, content []any) map[string]any {
		return map[string]any{"type": "message", "id": msgID, "status": status, "role": "assistant", "content": content}
	}
	response := func(status string, output []any, usage any) map[string]any {
		return map[string]any{"id": id, "object": "response", "created_at": 1700000000, "status": status, "model": model,
			"output": output, "usage": usage, "error": nil, "incomplete_details": nil, "parallel_tool_calls": true,
			"tool_choice": "auto", "tools": []any{}, "text": map[string]any{"format": map[string]any{"type": "text"}}}
	}
	done := item("completed", []any{part(text)})
	if !stream {
		writeE2EJSON(w, response("completed", []any{done}, usage))
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	fl := w.(http.Flusher)
	seq := 0
	send := func(typ string, ev map[string]any) {
		ev["type"], ev["sequence_number"] = typ, seq
		seq++
		b, _ := json.Marshal(ev)
		fmt.Fprintf(w, "event: %s\ndata: %s\n\n", typ, b)
		fl.Flush()
	}
	send("response.created", map[string]any{"response": response("in_progress", []any{}, nil)})
	send("response.in_progress", map[string]any{"response": response("in_progress", []any{}, nil)})
	send("response.output_item.added", map[string]any{"output_index": 0, "item": item("in_progress", []any{})})
	send("response.content_part.added", map[string]any{"output_index": 0, "content_index": 0, "item_id": msgID, "part": part("")})
	for _, wd := range words {
		send("response.output_text.delta", map[string]any{"output_index": 0, "content_index": 0, "item_id": msgID, "delta": wd, "logprobs": []any{}})
	}
	send("response.output_text.done", map[string]any{"output_index": 0, "content_index": 0, "item_id": msgID, "text": text, "logprobs": []any{}})
	send("response.content_part.done", map[string]any{"output_index": 0, "content_index": 0, "item_id": msgID, "part": part(text)})
	send("response.output_item.done", map[string]any{"output_index": 0, "item": done})
	send("response.completed", map[string]any{"response": response("completed", []any{done}, usage)})
}

func (u *e2eUpstream) embeddings(w http.ResponseWriter, body map[string]any, model string, rec *e2eUpRequest) {
	var inputs []any
	switch in := body["input"].(type) {
	case []any:
		inputs = in
	default:
		inputs = []any{in}
	}
	data := make([]any, 0, len(inputs))
	for i := range inputs {
		data = append(data, map[string]any{"object": "embedding", "index": i, "embedding": []float64{0.25, -0.5, float64(i)}})
	}
	// A provider counts an embeddings call's inputs (two tokens each
	// here, as a tokenizer counts these short words), not a chat
	// history's 40+3n: faregate reserves the prompt alone for it, and a
	// report far above the input would be overage.
	rec.Prompt, rec.Completion = int64(2*len(inputs)), 0
	writeE2EJSON(w, map[string]any{"object": "list", "data": data, "model": model,
		"usage": map[string]any{"prompt_tokens": rec.Prompt, "total_tokens": rec.Prompt}})
}

func writeE2EJSON(w http.ResponseWriter, v any) {
	b, _ := json.Marshal(v)
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(b)
}
