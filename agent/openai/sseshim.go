package openai

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

// RoundTrip implements http.RoundTripper.
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
		return nil, fmt.Errorf("openai: read model answer: %w", err)
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

// completion is the part of a chat.completion object the shim carries over.
type completion struct {
	ID      string `json:"id"`
	Model   string `json:"model"`
	Choices []struct {
		Message struct {
			Content   string     `json:"content"`
			ToolCalls []toolCall `json:"tool_calls"`
		} `json:"message"`
		FinishReason string `json:"finish_reason"`
	} `json:"choices"`
	// Usage is passed on as it came: the provider reads it from the last chunk.
	Usage json.RawMessage `json:"usage"`
}

// toolCall is a tool call in a completion, and with Index set, a tool-call
// delta in a chunk.
type toolCall struct {
	Index    *int   `json:"index,omitempty"`
	ID       string `json:"id"`
	Type     string `json:"type"`
	Function struct {
		Name string `json:"name"`
		// Arguments is a JSON string by the API's definition; some servers
		// send the object itself, which is carried as its JSON text.
		Arguments arguments `json:"arguments"`
	} `json:"function"`
}

// arguments reads a JSON string, or any other JSON value as its text, and
// writes a JSON string.
type arguments string

func (a *arguments) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err == nil {
		*a = arguments(s)
		return nil
	}
	*a = arguments(b)
	return nil
}

// sseChunk is one chat.completion.chunk event.
type sseChunk struct {
	ID      string          `json:"id"`
	Object  string          `json:"object"`
	Model   string          `json:"model,omitempty"`
	Choices []sseChoice     `json:"choices"`
	Usage   json.RawMessage `json:"usage,omitempty"`
}

type sseChoice struct {
	Index        int     `json:"index"`
	Delta        delta   `json:"delta"`
	FinishReason *string `json:"finish_reason"`
}

type delta struct {
	Role      string     `json:"role,omitempty"`
	Content   string     `json:"content,omitempty"`
	ToolCalls []toolCall `json:"tool_calls,omitempty"`
}

// completionToSSE turns a chat.completion object into chunks: the message
// (content and tool calls with their index), the finish reason, the usage.
// Anything else (an error object, a malformed body) is left alone.
func completionToSSE(raw []byte) ([]byte, bool) {
	var c completion
	if err := json.Unmarshal(raw, &c); err != nil || len(c.Choices) == 0 {
		return nil, false
	}
	msg := c.Choices[0].Message
	d := delta{Role: "assistant", Content: msg.Content, ToolCalls: msg.ToolCalls}
	for i := range d.ToolCalls {
		d.ToolCalls[i].Index = &i
		if d.ToolCalls[i].Type == "" {
			d.ToolCalls[i].Type = "function"
		}
	}
	var out bytes.Buffer
	write := func(v sseChunk) {
		v.Object = "chat.completion.chunk"
		b, _ := json.Marshal(v)
		out.WriteString("data: ")
		out.Write(b)
		out.WriteString("\n\n")
	}
	write(sseChunk{ID: c.ID, Model: c.Model, Choices: []sseChoice{{Delta: d}}})
	finish := c.Choices[0].FinishReason
	if finish == "" {
		finish = "stop"
	}
	write(sseChunk{ID: c.ID, Model: c.Model, Choices: []sseChoice{{FinishReason: &finish}}})
	if len(c.Usage) > 0 && string(c.Usage) != "null" {
		write(sseChunk{ID: c.ID, Choices: []sseChoice{}, Usage: c.Usage})
	}
	out.WriteString("data: [DONE]\n\n")
	return out.Bytes(), true
}
