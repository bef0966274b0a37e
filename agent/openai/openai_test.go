package openai

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"faregate/agent/chat"
	"faregate/agent/task"
	"faregate/protect/breaker"
	"faregate/protect/kit/testkit/clocktest"
)

// wireRequest is what the tests read of a /chat/completions request.
type wireRequest struct {
	Model               string           `json:"model"`
	Stream              bool             `json:"stream"`
	MaxTokens           int              `json:"max_tokens"`
	MaxCompletionTokens int              `json:"max_completion_tokens"`
	Messages            []map[string]any `json:"messages"`
	Tools               []struct {
		Type     string       `json:"type"`
		Function chat.ToolDef `json:"function"`
	} `json:"tools"`
}

// server is an OpenAI-compatible test server whose answer is the body
// answer writes for each request.
type server struct {
	*httptest.Server
	mu   sync.Mutex
	reqs []wireRequest
}

func newServer(t *testing.T, answer func(w http.ResponseWriter, req wireRequest)) *server {
	t.Helper()
	s := &server{}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req wireRequest
		if r.URL.Path != "/v1/chat/completions" || json.NewDecoder(r.Body).Decode(&req) != nil {
			http.Error(w, "bad request", http.StatusBadRequest)
			return
		}
		s.mu.Lock()
		s.reqs = append(s.reqs, req)
		s.mu.Unlock()
		answer(w, req)
	}))
	t.Cleanup(s.Close)
	return s
}

func (s *server) requests() []wireRequest {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]wireRequest(nil), s.reqs...)
}

// sse writes events as a streaming server does.
func sse(w http.ResponseWriter, events ...string) {
	w.Header().Set("Content-Type", "text/event-stream")
	for _, e := range events {
		fmt.Fprintf(w, "data: %s\n\n", e)
	}
	io.WriteString(w, "data: [DONE]\n\n")
}

func model(t *testing.T, s *server, o Options) *Model {
	t.Helper()
	o.BaseURL = s.URL + "/v1"
	m, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// collect is a Stream that records what it was given.
type collect struct{ text, calls strings.Builder }

func (c *collect) stream(ch chat.Chunk) error {
	c.text.WriteString(ch.Text)
	c.calls.WriteString(ch.ToolCall)
	return nil
}

// TestConversationOnTheWire: a whole conversation is sent the way the chat
// API expects it, typed data stays home, and a streamed text answer comes
// back with the provider's usage.
func TestConversationOnTheWire(t *testing.T) {
	s := newServer(t, func(w http.ResponseWriter, _ wireRequest) {
		sse(w,
			`{"id":"1","choices":[{"index":0,"delta":{"role":"assistant","content":"{\"summary\":"}}]}`,
			`{"id":"1","choices":[{"index":0,"delta":{"content":"\"Lisbon\"}"}}]}`,
			`{"id":"1","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}`,
			`{"id":"1","choices":[],"usage":{"prompt_tokens":120,"completion_tokens":7,"total_tokens":127}}`)
	})
	m := model(t, s, Options{Model: "test-model"})
	if m.Name() != "test-model" {
		t.Fatalf("name %q", m.Name())
	}
	req := task.Request{Destination: "Lisbon", Days: 1}
	turn := chat.Turn{
		Messages: []chat.Message{
			chat.Text(chat.RoleSystem, "plan trips"),
			chat.Text(chat.RoleUser, "Lisbon, 1 day"),
			{Role: chat.RoleAssistant, ToolCalls: []chat.ToolCall{{ID: "call_1", Name: "weather", Arguments: `{"location":"Lisbon"}`}}},
			{Role: chat.RoleTool, ToolCallID: "call_1", Name: "weather", Content: "sunny", Data: struct{ Secret string }{"never sent"}},
		},
		Tools:     []chat.ToolDef{{Name: "weather", Description: "forecast", Parameters: map[string]any{"type": "object"}}},
		MaxTokens: 300,
		Request:   &req,
	}
	var got collect
	turn.Stream = got.stream
	reply, err := m.Generate(context.Background(), turn)
	if err != nil {
		t.Fatal(err)
	}
	if reply.Content != `{"summary":"Lisbon"}` || got.text.String() != reply.Content || got.calls.Len() != 0 {
		t.Fatalf("reply %+v, streamed %q", reply, got.text.String())
	}
	if u := reply.Usage; u.PromptTokens != 120 || u.CompletionTokens != 7 || !u.Reported || u.Unreadable || reply.StopReason != "stop" {
		t.Fatalf("usage %+v stop %q", reply.Usage, reply.StopReason)
	}
	wire := s.requests()[0]
	if wire.Model != "test-model" || !wire.Stream || wire.MaxCompletionTokens != 300 || wire.MaxTokens != 0 {
		t.Fatalf("request %+v", wire)
	}
	if len(wire.Tools) != 1 || wire.Tools[0].Type != "function" || wire.Tools[0].Function.Name != "weather" {
		t.Fatalf("tools %+v", wire.Tools)
	}
	roles := []string{}
	for _, msg := range wire.Messages {
		roles = append(roles, fmt.Sprint(msg["role"]))
	}
	if strings.Join(roles, ",") != "system,user,assistant,tool" {
		t.Fatalf("roles %v", roles)
	}
	calls, _ := json.Marshal(wire.Messages[2]["tool_calls"])
	if !strings.Contains(string(calls), `"id":"call_1"`) || !strings.Contains(string(calls), `"name":"weather"`) {
		t.Errorf("assistant tool calls %s", calls)
	}
	if wire.Messages[3]["tool_call_id"] != "call_1" || wire.Messages[3]["content"] != "sunny" {
		t.Errorf("tool message %v", wire.Messages[3])
	}
	raw, _ := json.Marshal(wire.Messages)
	if strings.Contains(string(raw), "never sent") {
		t.Error("typed tool data was sent to the provider")
	}
}

// TestStreamedToolCalls: tool-call deltas reach the stream as tool-call
// output (names and arguments), not as text, and the reply has them typed.
func TestStreamedToolCalls(t *testing.T) {
	s := newServer(t, func(w http.ResponseWriter, _ wireRequest) {
		sse(w,
			`{"id":"2","choices":[{"index":0,"delta":{"role":"assistant","tool_calls":[{"index":0,"id":"call_a","type":"function","function":{"name":"guide_search","arguments":""}}]}}]}`,
			`{"id":"2","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"query\":"}}]}}]}`,
			`{"id":"2","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\"Lisbon food\"}"}}]}}]}`,
			`{"id":"2","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}`)
	})
	var got collect
	reply, err := model(t, s, Options{}).Generate(context.Background(), chat.Turn{
		Messages: []chat.Message{chat.Text(chat.RoleUser, "go")}, MaxTokens: 50, Stream: got.stream,
		Tools: []chat.ToolDef{{Name: "guide_search"}}})
	if err != nil {
		t.Fatal(err)
	}
	want := []chat.ToolCall{{ID: "call_a", Name: "guide_search", Arguments: `{"query":"Lisbon food"}`}}
	if len(reply.ToolCalls) != 1 || reply.ToolCalls[0] != want[0] || reply.Content != "" {
		t.Fatalf("reply %+v", reply)
	}
	if got.text.Len() != 0 || got.calls.String() != `guide_search{"query":"Lisbon food"}` {
		t.Fatalf("streamed text %q, tool output %q", got.text.String(), got.calls.String())
	}
	if reply.Usage.Reported {
		t.Errorf("usage reported without a usage chunk: %+v", reply.Usage)
	}
	if s.requests()[0].Model != DefaultModel {
		t.Errorf("model %q, want the provider default named", s.requests()[0].Model)
	}
}

// TestServerAnsweringInOnePiece: a server that ignores "stream": true and
// answers with one chat.completion (tool call arguments as an object, even)
// still yields the answer, its tool calls and its usage.
func TestServerAnsweringInOnePiece(t *testing.T) {
	answers := []string{
		`{"id":"3","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"c1","function":{"name":"weather","arguments":{"location":"Rome"}}}]},"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":300,"completion_tokens":12}}`,
		`{"id":"4","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"done"}}]}`,
	}
	n := 0
	s := newServer(t, func(w http.ResponseWriter, _ wireRequest) {
		w.Header().Set("Content-Type", "application/json; charset=utf-8")
		io.WriteString(w, answers[n])
		n++
	})
	m := model(t, s, Options{LegacyMaxTokens: true})
	var got collect
	reply, err := m.Generate(context.Background(), chat.Turn{Messages: []chat.Message{chat.Text(chat.RoleUser, "go")},
		MaxTokens: 64, Stream: got.stream, Tools: []chat.ToolDef{{Name: "weather"}}})
	if err != nil {
		t.Fatal(err)
	}
	if len(reply.ToolCalls) != 1 || reply.ToolCalls[0].Arguments != `{"location":"Rome"}` || reply.ToolCalls[0].ID != "c1" {
		t.Fatalf("tool calls %+v", reply.ToolCalls)
	}
	if u := reply.Usage; u.PromptTokens != 300 || u.CompletionTokens != 12 || !u.Reported || u.Unreadable {
		t.Fatalf("usage %+v", reply.Usage)
	}
	reply, err = m.Generate(context.Background(), chat.Turn{Messages: []chat.Message{chat.Text(chat.RoleUser, "go")}, MaxTokens: 64, Stream: got.stream})
	if err != nil || reply.Content != "done" || reply.StopReason != "stop" {
		t.Fatalf("second answer %+v %v", reply, err)
	}
	if w := s.requests()[0]; w.MaxTokens != 64 || w.MaxCompletionTokens != 0 {
		t.Errorf("legacy field: max_tokens %d, max_completion_tokens %d", w.MaxTokens, w.MaxCompletionTokens)
	}
}

// TestFailures: a stream the caller stops, an error status, a deadline
// and a message role the API has no name for are errors.
func TestFailures(t *testing.T) {
	s := newServer(t, func(w http.ResponseWriter, req wireRequest) {
		switch req.Messages[0]["content"] {
		case "fail":
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusInternalServerError)
			io.WriteString(w, `{"error":{"message":"boom"}}`)
		default:
			sse(w, `{"id":"5","choices":[{"index":0,"delta":{"content":"one"}}]}`, `{"id":"5","choices":[{"index":0,"delta":{"content":"two"}}]}`)
		}
	})
	m := model(t, s, Options{})
	stop := errors.New("cut")
	_, err := m.Generate(context.Background(), chat.Turn{Messages: []chat.Message{chat.Text(chat.RoleUser, "go")}, MaxTokens: 10,
		Stream: func(chat.Chunk) error { return stop }})
	if !errors.Is(err, stop) {
		t.Errorf("stopped stream: %v", err)
	}
	if _, err := m.Generate(context.Background(), chat.Turn{Messages: []chat.Message{chat.Text(chat.RoleUser, "fail")}, MaxTokens: 10}); err == nil || !strings.Contains(err.Error(), "500") {
		t.Errorf("500: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := m.Generate(ctx, chat.Turn{Messages: []chat.Message{chat.Text(chat.RoleUser, "go")}, MaxTokens: 10}); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled: %v", err)
	}
	if _, err := m.Generate(context.Background(), chat.Turn{Messages: []chat.Message{{Role: "narrator"}}}); err == nil {
		t.Error("unknown role accepted")
	}
}

func TestChunkTyping(t *testing.T) {
	cases := []struct {
		raw  string
		want chat.Chunk
	}{
		{"plain text", chat.Chunk{Text: "plain text"}},
		{`[{"id":"c","type":"function","function":{"name":"weather","arguments":""}}]`, chat.Chunk{ToolCall: "weather"}},
		{`[{"index":0,"id":"c2","type":"function","function":{"name":"","arguments":""}}]`, chat.Chunk{}},
		// Text that happens to be a JSON array of objects is still text.
		{`[{"a":1}]`, chat.Chunk{Text: `[{"a":1}]`}},
		{`[{ not json`, chat.Chunk{Text: `[{ not json`}},
	}
	for _, tc := range cases {
		if got := chunk([]byte(tc.raw)); got != tc.want {
			t.Errorf("chunk(%q) = %+v, want %+v", tc.raw, got, tc.want)
		}
	}
}

// TestUpstreamFacts: what the provider did reaches the breaker as facts it
// judges, not as langchaingo's text: the status and Retry-After of a
// refusal, a refused connection, a transport's timeout.
func TestUpstreamFacts(t *testing.T) {
	s := newServer(t, func(w http.ResponseWriter, req wireRequest) {
		switch c := req.Messages[0]["content"]; c {
		case "400", "429", "503":
			if c == "429" {
				w.Header().Set("Retry-After", "7")
			}
			w.Header().Set("Content-Type", "application/json")
			code := map[string]int{"400": 400, "429": 429, "503": 503}[c.(string)]
			w.WriteHeader(code)
			io.WriteString(w, `{"error":{"message":"no"}}`)
		case "slow":
			clocktest.Pass(300 * time.Millisecond) // a provider slow to its first byte
			sse(w, `{"id":"5","choices":[{"index":0,"delta":{"content":"late"}}]}`)
		}
	})
	turn := func(text string) chat.Turn {
		return chat.Turn{Messages: []chat.Message{chat.Text(chat.RoleUser, text)}, MaxTokens: 10}
	}
	m := model(t, s, Options{})
	for _, c := range []struct {
		text  string
		fault breaker.Fault
		after time.Duration
	}{
		{"400", breaker.CallerFault, 0},
		{"429", breaker.RateLimitFault, 7 * time.Second},
		{"503", breaker.ProviderFault, 0},
	} {
		_, err := m.Generate(context.Background(), turn(c.text))
		var j breaker.Judged
		var se *StatusError
		if !errors.As(err, &j) || j.BreakerFault() != c.fault || !errors.As(err, &se) || se.RetryAfter() != c.after {
			t.Errorf("%s: %v, want fault %d after %v", c.text, err, c.fault, c.after)
		}
	}

	timeout := model(t, s, Options{HTTPClient: &http.Client{Timeout: 50 * time.Millisecond}})
	_, err := timeout.Generate(context.Background(), turn("slow"))
	var to interface{ Timeout() bool }
	if !errors.As(err, &to) || !to.Timeout() {
		t.Errorf("a transport timeout: %v, want an error that says Timeout", err)
	}

	dead := httptest.NewServer(http.NotFoundHandler())
	addr := dead.URL
	dead.Close()
	m, err = New(Options{BaseURL: addr + "/v1"})
	if err != nil {
		t.Fatal(err)
	}
	_, err = m.Generate(context.Background(), turn("hi"))
	var op *net.OpError
	if !errors.As(err, &op) {
		t.Errorf("a refused connection: %v, want the transport's *net.OpError", err)
	}
}
