package gateway

import (
	"fmt"
	"io"
	"net/http"
	"testing"
)

// TestRefusedByProvider: an answer the provider's content rules stopped,
// or that is a refusal, is marked Refused whatever its shape (chat or
// Responses, JSON or stream); an ordinary answer, and one cut at its
// length, are not.
func TestRefusedByProvider(t *testing.T) {
	var serve func(w http.ResponseWriter)
	up := newScripted(t, func(w http.ResponseWriter, _ *http.Request, _ map[string]any) { serve(w) })
	e := newEnv(t, up.upstream(), nil)
	jsonAnswer := func(body string) func(w http.ResponseWriter) {
		return func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, body)
		}
	}
	stream := func(events ...string) func(w http.ResponseWriter) {
		return func(w http.ResponseWriter) { sse(w, events...) }
	}
	const (
		chat      = `{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}`
		chatSSE   = `{"model":"gpt-4o-mini","stream":true,"messages":[{"role":"user","content":"hi"}]}`
		resp      = `{"model":"gpt-4o-mini","input":"hi"}`
		respSSE   = `{"model":"gpt-4o-mini","stream":true,"input":"hi"}`
		chunkStop = `data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{},"finish_reason":"%s"}]}`
	)
	for _, tc := range []struct {
		name, path, body string
		serve            func(w http.ResponseWriter)
		refused          bool
	}{
		{"chat answer", "/v1/chat/completions", chat,
			jsonAnswer(`{"choices":[{"message":{"content":"Seven hills."},"finish_reason":"stop"}]}`), false},
		{"chat content filter", "/v1/chat/completions", chat,
			jsonAnswer(`{"choices":[{"message":{"content":""},"finish_reason":"content_filter"}]}`), true},
		{"chat refusal", "/v1/chat/completions", chat,
			jsonAnswer(`{"choices":[{"message":{"content":null,"refusal":"I can't help with that."},"finish_reason":"stop"}]}`), true},
		{"chat stream", "/v1/chat/completions", chatSSE,
			stream(chunkJSON("Seven hills."), fmt.Sprintf(chunkStop, "stop"), "data: [DONE]"), false},
		{"chat stream cut by length", "/v1/chat/completions", chatSSE,
			stream(chunkJSON("Seven"), fmt.Sprintf(chunkStop, "length"), "data: [DONE]"), false},
		{"chat stream content filter", "/v1/chat/completions", chatSSE,
			stream(chunkJSON("Seven"), fmt.Sprintf(chunkStop, "content_filter"), "data: [DONE]"), true},
		{"chat stream refusal", "/v1/chat/completions", chatSSE,
			stream(`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{"refusal":"No."},"finish_reason":null}]}`, "data: [DONE]"), true},
		{"responses answer", "/v1/responses", resp,
			jsonAnswer(`{"id":"r","object":"response","status":"completed","output":[{"type":"message","content":[{"type":"output_text","text":"ok"}]}]}`), false},
		{"responses content filter", "/v1/responses", resp,
			jsonAnswer(`{"id":"r","object":"response","status":"incomplete","incomplete_details":{"reason":"content_filter"},"output":[]}`), true},
		{"responses refusal", "/v1/responses", resp,
			jsonAnswer(`{"id":"r","object":"response","status":"completed","output":[{"type":"message","content":[{"type":"refusal","refusal":"No."}]}]}`), true},
		{"responses stream refusal", "/v1/responses", respSSE,
			stream(`event: response.refusal.delta`+"\n"+`data: {"type":"response.refusal.delta","sequence_number":0,"item_id":"m","output_index":0,"content_index":0,"delta":"No."}`,
				`event: response.completed`+"\n"+`data: {"type":"response.completed","sequence_number":1,"response":{"id":"r","status":"completed","output":[]}}`), true},
		{"responses stream content filter", "/v1/responses", respSSE,
			stream(`event: response.incomplete` + "\n" + `data: {"type":"response.incomplete","sequence_number":0,"response":{"id":"r","status":"incomplete","incomplete_details":{"reason":"content_filter"},"output":[]}}`), true},
		{"responses stream", "/v1/responses", respSSE,
			stream(`event: response.output_text.delta`+"\n"+`data: {"type":"response.output_text.delta","sequence_number":0,"item_id":"m","output_index":0,"content_index":0,"delta":"ok"}`,
				`event: response.completed`+"\n"+`data: {"type":"response.completed","sequence_number":1,"response":{"id":"r","status":"completed","output":[]}}`), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			serve = tc.serve
			if r, b := e.post(t, tc.path, tc.body); r.StatusCode != 200 {
				t.Fatalf("%d %s", r.StatusCode, b)
			}
			if _, _, out, err := e.gov.last(t); err != nil || out.Refused != tc.refused {
				t.Fatalf("outcome %+v, %v; want Refused %v", out, err, tc.refused)
			}
		})
	}
}
