package agent

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strconv"
)

// streamShim lets a streaming call work against servers that ignore
// "stream": true and answer with one JSON chat.completion (some proxies,
// simple OpenAI-compatible servers, test doubles). langchaingo decides how
// to parse by what it asked for, not by what came back, and would read such
// an answer as an empty stream; the shim rewrites it into the equivalent
// Server-Sent Events, so the answer, its tool calls and its usage survive.
type streamShim struct{ next http.RoundTripper }

// maxShimBody bounds a non-streamed answer the shim will rewrite.
const maxShimBody = 4 << 20

func (s streamShim) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := s.next.RoundTrip(req)
	if err != nil || resp.StatusCode != http.StatusOK {
		return resp, err
	}
	mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	if mt != "application/json" {
		return resp, nil
	}
	raw, err := io.ReadAll(io.LimitReader(resp.Body, maxShimBody))
	resp.Body.Close()
	if err != nil {
		return nil, fmt.Errorf("agent: read model answer: %w", err)
	}
	if sse, ok := completionToSSE(raw); ok {
		raw = sse
		resp.Header.Set("Content-Type", "text/event-stream")
	}
	resp.Body = io.NopCloser(bytes.NewReader(raw))
	resp.ContentLength = int64(len(raw))
	resp.Header.Set("Content-Length", strconv.Itoa(len(raw)))
	return resp, nil
}

// completionToSSE turns a chat.completion object into chunks: the message
// (content and tool calls with their index), the finish reason, the usage.
// Anything else (an error object, a malformed body) is left alone.
func completionToSSE(raw []byte) ([]byte, bool) {
	var c struct {
		ID      string `json:"id"`
		Model   string `json:"model"`
		Choices []struct {
			Message struct {
				Role      string           `json:"role"`
				Content   string           `json:"content"`
				ToolCalls []map[string]any `json:"tool_calls"`
			} `json:"message"`
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
		Usage json.RawMessage `json:"usage"`
	}
	if err := json.Unmarshal(raw, &c); err != nil || len(c.Choices) == 0 {
		return nil, false
	}
	msg := c.Choices[0].Message
	delta := map[string]any{"role": "assistant"}
	if msg.Content != "" {
		delta["content"] = msg.Content
	}
	if len(msg.ToolCalls) > 0 {
		for i, tc := range msg.ToolCalls {
			tc["index"] = i
			if tc["type"] == nil {
				tc["type"] = "function"
			}
		}
		delta["tool_calls"] = msg.ToolCalls
	}
	var out bytes.Buffer
	write := func(v any) {
		b, _ := json.Marshal(v)
		out.WriteString("data: ")
		out.Write(b)
		out.WriteString("\n\n")
	}
	chunk := func(d map[string]any, finish any) map[string]any {
		return map[string]any{"id": c.ID, "object": "chat.completion.chunk", "model": c.Model,
			"choices": []any{map[string]any{"index": 0, "delta": d, "finish_reason": finish}}}
	}
	write(chunk(delta, nil))
	finish := c.Choices[0].FinishReason
	if finish == "" {
		finish = "stop"
	}
	write(chunk(map[string]any{}, finish))
	if len(c.Usage) > 0 && string(c.Usage) != "null" {
		write(map[string]any{"id": c.ID, "object": "chat.completion.chunk", "choices": []any{}, "usage": c.Usage})
	}
	out.WriteString("data: [DONE]\n\n")
	return out.Bytes(), true
}
