package gateway

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	"github.com/anthropics/anthropic-sdk-go/v2/option"

	"faregate/agent/offline"
)

// testAnthropicErrors is the router's error writer for the Messages
// routes: the status and code of the package doc's table, in Anthropic's
// shape, with the headers writeTestError sets.
type testAnthropicErrors struct{}

func (testAnthropicErrors) status(err error) (int, string, string) {
	status, code := 500, "internal_error"
	for _, e := range testErrors {
		if errors.Is(err, e.err) {
			status, code = e.status, e.code
			break
		}
	}
	msg := err.Error()
	var pe *ParamError
	if errors.As(err, &pe) {
		msg = pe.Field + ": " + pe.Reason
	}
	return status, code, msg
}

func (e testAnthropicErrors) WriteError(w http.ResponseWriter, r *http.Request, err error) {
	status, code, msg := e.status(err)
	if d, ok := retryAfterOf(err); ok {
		w.Header().Set("Retry-After", itoa(int64((d+time.Second-1)/time.Second)))
	}
	if status == http.StatusTooManyRequests && code != "too_many_calls" {
		w.Header().Set("X-Should-Retry", "false")
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Request-Id", "req_test")
	w.WriteHeader(status)
	_, _ = w.Write(testAnthropicBody(status, code, msg))
}

func (e testAnthropicErrors) ErrorEvent(r *http.Request, err error) []byte {
	status, code, msg := e.status(err)
	return testAnthropicBody(status, code, msg)
}

// msgMux routes the Messages handlers as the api's router does, reading
// a POST body whole.
func msgMux(h MessagesHandlers) http.Handler {
	calls := map[string]Call{"/v1/messages": h.Messages, "/v1/messages/count_tokens": h.CountTokens}
	return routeTest(calls, h.Models, h.Model, testAnthropicErrors{}.WriteError)
}

// msgEnv is the Messages handler in front of an upstream of one wire, and
// Anthropic's Go SDK as the agent.
type msgEnv struct {
	gov    *fakeGov
	srv    *httptest.Server
	client anthropic.Client
	task   Task
}

const claudeModel = "claude-sonnet-4-5"

func newMsgEnv(t *testing.T, up Upstream, wire string, mod func(*Options, *MessagesOptions)) *msgEnv {
	t.Helper()
	e := &msgEnv{gov: &fakeGov{up: &up, cap: 4000}}
	e.task = Task{ID: "t_test", Principal: "p1", Tier: "public", Deadline: time.Now().Add(time.Hour),
		Models: []string{claudeModel, testModel, offline.ModelName}}
	o := Options{Governor: e.gov, Records: testRecords, Task: func(*http.Request) (Task, bool) { return e.task, true }, Errors: testAnthropicErrors{}}
	mo := MessagesOptions{Wire: wire}
	if mod != nil {
		mod(&o, &mo)
	}
	e.srv = httptest.NewServer(msgMux(NewMessages(o, mo)))
	t.Cleanup(e.srv.Close)
	e.client = anthropic.NewClient(option.WithBaseURL(e.srv.URL), option.WithAPIKey("fgt_test"), option.WithMaxRetries(0))
	return e
}

// post sends a raw request to the handler with the headers given.
func (e *msgEnv) post(t *testing.T, path, body string, header ...string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, e.srv.URL+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Add(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

// anthropicUpstream is a Messages provider a test scripts: it keeps each
// request's body and headers.
type anthropicUpstream struct {
	*scripted
	headers []http.Header
}

func newAnthropicUpstream(t *testing.T, serve func(w http.ResponseWriter, r *http.Request, body map[string]any)) *anthropicUpstream {
	t.Helper()
	a := &anthropicUpstream{}
	a.scripted = newScripted(t, func(w http.ResponseWriter, r *http.Request, body map[string]any) {
		a.mu.Lock()
		a.headers = append(a.headers, r.Header.Clone())
		a.mu.Unlock()
		serve(w, r, body)
	})
	return a
}

func (a *anthropicUpstream) raw(t *testing.T, i int) string {
	t.Helper()
	a.mu.Lock()
	defer a.mu.Unlock()
	if i >= len(a.bodies) {
		t.Fatalf("the upstream got %d requests, want more than %d", len(a.bodies), i)
	}
	return string(a.bodies[i])
}

// event is one Messages SSE event as a provider writes it.
func event(v map[string]any) string {
	b, _ := json.Marshal(v)
	return "event: " + v["type"].(string) + "\ndata: " + string(b)
}

// msgStream is an honest Anthropic stream: a thinking block, a text
// block, a tool_use block, each in pieces, usage as Anthropic reports it
// (cache fields in message_start, cumulative message_delta).
func msgStream() []string {
	return []string{
		event(map[string]any{"type": "message_start", "message": map[string]any{"id": "msg_1", "type": "message", "role": "assistant",
			"model": claudeModel, "content": []any{}, "stop_reason": nil, "stop_sequence": nil,
			"usage": map[string]any{"input_tokens": 12, "cache_creation_input_tokens": 100, "cache_read_input_tokens": 2000, "output_tokens": 1}}}),
		event(map[string]any{"type": "content_block_start", "index": 0, "content_block": map[string]any{"type": "thinking", "thinking": "", "signature": ""}}),
		event(map[string]any{"type": "content_block_delta", "index": 0, "delta": map[string]any{"type": "thinking_delta", "thinking": "The user wants "}}),
		event(map[string]any{"type": "content_block_delta", "index": 0, "delta": map[string]any{"type": "thinking_delta", "thinking": "the weather."}}),
		event(map[string]any{"type": "content_block_delta", "index": 0, "delta": map[string]any{"type": "signature_delta", "signature": "c2ln"}}),
		event(map[string]any{"type": "content_block_stop", "index": 0}),
		"event: ping\ndata: {\"type\": \"ping\"}",
		event(map[string]any{"type": "content_block_start", "index": 1, "content_block": map[string]any{"type": "text", "text": ""}}),
		event(map[string]any{"type": "content_block_delta", "index": 1, "delta": map[string]any{"type": "text_delta", "text": "Let me look "}}),
		event(map[string]any{"type": "content_block_delta", "index": 1, "delta": map[string]any{"type": "text_delta", "text": "that up."}}),
		event(map[string]any{"type": "content_block_stop", "index": 1}),
		event(map[string]any{"type": "content_block_start", "index": 2, "content_block": map[string]any{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": map[string]any{}}}),
		event(map[string]any{"type": "content_block_delta", "index": 2, "delta": map[string]any{"type": "input_json_delta", "partial_json": `{"city": `}}),
		event(map[string]any{"type": "content_block_delta", "index": 2, "delta": map[string]any{"type": "input_json_delta", "partial_json": `"Lisbon"}`}}),
		event(map[string]any{"type": "content_block_stop", "index": 2}),
		event(map[string]any{"type": "message_delta", "delta": map[string]any{"stop_reason": "tool_use", "stop_sequence": nil},
			"usage": map[string]any{"output_tokens": 40}}),
		event(map[string]any{"type": "message_stop"}),
	}
}

// msgAnswerJSON is msgStream's message as one JSON answer.
const msgAnswerJSON = `{"id":"msg_1","type":"message","role":"assistant","model":"` + claudeModel + `","content":[` +
	`{"type":"thinking","thinking":"The user wants the weather.","signature":"c2ln"},` +
	`{"type":"text","text":"Let me look that up."},` +
	`{"type":"tool_use","id":"toolu_1","name":"get_weather","input":{"city":"Lisbon"}}],` +
	`"stop_reason":"tool_use","stop_sequence":null,` +
	`"usage":{"input_tokens":12,"cache_creation_input_tokens":100,"cache_read_input_tokens":2000,"output_tokens":40}}`

// sameMessage fails unless a and b hold the same content, stop reason
// and usage.
func sameMessage(t *testing.T, what string, a, b *anthropic.Message) {
	t.Helper()
	blocks := func(m *anthropic.Message) string {
		var s []string
		for _, c := range m.Content {
			in := ""
			if len(c.Input) > 0 {
				var v any
				_ = json.Unmarshal(c.Input, &v)
				raw, _ := json.Marshal(v)
				in = string(raw)
			}
			s = append(s, strings.Join([]string{c.Type, c.Text, c.Thinking, c.Signature, c.ID, c.Name, in}, "|"))
		}
		return strings.Join(s, "\n")
	}
	if blocks(a) != blocks(b) || a.StopReason != b.StopReason || a.Usage.InputTokens != b.Usage.InputTokens ||
		a.Usage.OutputTokens != b.Usage.OutputTokens || a.Usage.CacheReadInputTokens != b.Usage.CacheReadInputTokens ||
		a.Usage.CacheCreationInputTokens != b.Usage.CacheCreationInputTokens || a.Model != b.Model {
		t.Fatalf("%s: the messages differ:\n%s\n%s %+v\n---\n%s\n%s %+v", what, a.Model, blocks(a), a.Usage, b.Model, blocks(b), b.Usage)
	}
}

// accumulate reads a stream through the SDK's accumulator.
func accumulate(t *testing.T, e *msgEnv, params anthropic.MessageNewParams) (*anthropic.Message, error) {
	t.Helper()
	stream := e.client.Messages.NewStreaming(t.Context(), params)
	defer stream.Close()
	var msg anthropic.Message
	for stream.Next() {
		if err := msg.Accumulate(stream.Current()); err != nil {
			return &msg, err
		}
	}
	return &msg, stream.Err()
}

// sseEvents splits a raw SSE answer into its events' names and data.
func sseEvents(t *testing.T, raw string) (names []string, data []map[string]any) {
	t.Helper()
	for _, ev := range strings.Split(strings.TrimSpace(raw), "\n\n") {
		var name string
		var d []byte
		for _, line := range strings.Split(ev, "\n") {
			if v, ok := strings.CutPrefix(line, "event: "); ok {
				name = v
			}
			if v, ok := strings.CutPrefix(line, "data: "); ok {
				d = append(d, v...)
			}
		}
		var m map[string]any
		if err := json.Unmarshal(bytes.TrimSpace(d), &m); err != nil {
			t.Fatalf("event %q is not JSON: %v", ev, err)
		}
		if m["type"] != name {
			t.Fatalf("event %q: its name and type differ", ev)
		}
		names, data = append(names, name), append(data, m)
	}
	return names, data
}

func userText(text string) anthropic.MessageNewParams {
	return anthropic.MessageNewParams{Model: claudeModel, MaxTokens: 1000,
		Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock(text))}}
}

// testAnthropicBody is an error in Anthropic's shape as api writes it
// (the type by status as the SDKs read it), for the tests' writer.
func testAnthropicBody(status int, code, msg string) []byte {
	typ := map[int]string{400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
		404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
		503: "overloaded_error"}[status]
	if typ == "" {
		typ = "api_error"
	}
	b, _ := json.Marshal(map[string]any{"type": "error", "error": map[string]any{"type": typ, "message": msg, "code": code},
		"request_id": "req_test"})
	return b
}
