package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	"github.com/anthropics/anthropic-sdk-go/v2/option"

	"faregate/protect/budget"
	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/kit/testkit/redistest"
)

// claudeAgent is an operator's agent written on Anthropic's Go SDK
// (github.com/anthropics/anthropic-sdk-go/v2), configured from the
// delivery's "anthropic" block: it lists the models, counts a prompt,
// makes a JSON call, the same call streamed (read through the SDK's
// accumulator), and a custom tool's round trip, then answers 200 with the
// JSON call's text. What it saw is kept for the test.
type claudeAgent struct {
	srv *httptest.Server
	mu  sync.Mutex
	// seen: the delivery's block, the models listed, the count, each
	// call's message as the SDK parsed it, and every error.
	block                   map[string]string
	models                  []string
	count                   int64
	json, streamed, toolEnd *anthropic.Message
	toolUse                 *anthropic.Message
	errs                    []string
}

func newClaudeAgent(t *testing.T) *claudeAgent {
	a := &claudeAgent{}
	a.srv = httptest.NewServer(http.HandlerFunc(a.serve))
	t.Cleanup(a.srv.Close)
	return a
}

func (a *claudeAgent) fail(format string, args ...any) {
	a.mu.Lock()
	a.errs = append(a.errs, fmt.Sprintf(format, args...))
	a.mu.Unlock()
}

var claudeWeatherTool = anthropic.ToolUnionParam{OfTool: &anthropic.ToolParam{Name: "get_weather",
	Description: anthropic.String("The weather of a city."),
	InputSchema: anthropic.ToolInputSchemaParam{Properties: map[string]any{"city": map[string]any{"type": "string"}}, Required: []string{"city"}}}}

func (a *claudeAgent) serve(w http.ResponseWriter, r *http.Request) {
	var d delivery
	raw, _ := io.ReadAll(r.Body)
	if err := json.Unmarshal(raw, &d.Body); err != nil {
		a.fail("delivery: %v", err)
		http.Error(w, "bad delivery", 400)
		return
	}
	b := d.Body.Anthropic
	a.mu.Lock()
	a.block = map[string]string{"base_url": b.BaseURL, "api_key": b.APIKey, "model": b.Model}
	a.mu.Unlock()
	ctx, cancel := context.WithDeadline(r.Context(), d.Body.Task.Deadline)
	defer cancel()
	// As the SDK is configured from the delivery: it appends /v1/messages
	// to the base URL and sends the key as x-api-key.
	client := anthropic.NewClient(option.WithBaseURL(b.BaseURL), option.WithAPIKey(b.APIKey), option.WithMaxRetries(0))
	model := anthropic.Model(b.Model)

	if page, err := client.Models.List(ctx, anthropic.ModelListParams{}); err != nil {
		a.fail("models: %v", err)
	} else {
		for _, m := range page.Data {
			a.models = append(a.models, m.ID)
		}
	}
	user := []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Three days in Lisbon, please."))}
	if n, err := client.Messages.CountTokens(ctx, anthropic.MessageCountTokensParams{Model: model, Messages: user}); err != nil {
		a.fail("count_tokens: %v", err)
	} else {
		a.count = n.InputTokens
	}
	params := anthropic.MessageNewParams{Model: model, MaxTokens: 300, Messages: user,
		System:        []anthropic.TextBlockParam{{Text: "You plan trips."}},
		StopSequences: []string{"THE END"}, Metadata: anthropic.MetadataParam{UserID: anthropic.String("visitor-1")}}
	// The Go SDK has no temperature of its own (Python's and TypeScript's do).
	temp := option.WithJSONSet("temperature", 0.2)
	msg, err := client.Messages.New(ctx, params, temp)
	if err != nil {
		a.fail("JSON call: %v", err)
		http.Error(w, "model call failed", 500)
		return
	}
	a.json = msg
	stream := client.Messages.NewStreaming(ctx, params, temp)
	var acc anthropic.Message
	for stream.Next() {
		if err := acc.Accumulate(stream.Current()); err != nil {
			a.fail("accumulate: %v", err)
		}
	}
	if err := stream.Err(); err != nil {
		a.fail("stream: %v", err)
	}
	stream.Close()
	a.streamed = &acc

	// A custom tool's round trip.
	tp := anthropic.MessageNewParams{Model: model, MaxTokens: 200, Tools: []anthropic.ToolUnionParam{claudeWeatherTool},
		Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Weather in Lisbon?"))}}
	if use, err := client.Messages.New(ctx, tp); err != nil {
		a.fail("tool call: %v", err)
	} else {
		a.toolUse = use
		var id string
		for _, c := range use.Content {
			if c.Type == "tool_use" {
				id = c.ID
			}
		}
		tp.Messages = append(tp.Messages, use.ToParam(), anthropic.NewUserMessage(anthropic.NewToolResultBlock(id, "21°C and sunny", false)))
		if end, err := client.Messages.New(ctx, tp); err != nil {
			a.fail("tool result: %v", err)
		} else {
			a.toolEnd = end
		}
	}
	text := ""
	for _, c := range msg.Content {
		text += c.Text
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{"result": map[string]any{"text": "# Lisbon\n\n" + text, "title": "Lisbon"}})
}

// claudeUpstream is an Anthropic-compatible provider: it records each
// request's raw body and headers, answers count_tokens with 4242, a call
// offering a tool that has no tool result yet with a tool_use, and any
// other with text, JSON or streamed, its usage with cache fields (the
// stream's in message_start, then a cumulative message_delta).
type claudeUpstream struct {
	srv  *httptest.Server
	mu   sync.Mutex
	reqs []claudeRequest
}

type claudeRequest struct {
	Path, Key, Version string
	Raw                []byte
	Body               map[string]any
}

// The upstream's usage of every call: the prompt reported is input +
// cache writes + cache reads, above anything faregate counts for these
// short prompts.
const (
	claudeInput, claudeCacheWrite, claudeCacheRead, claudeOutput = 400, 100, 200, 40
	claudeText                                                   = "Lisbon: hills, trams and tiles."
)

func newClaudeUpstream(t *testing.T) *claudeUpstream {
	u := &claudeUpstream{}
	u.srv = httptest.NewServer(http.HandlerFunc(u.serve))
	t.Cleanup(u.srv.Close)
	return u
}

func (u *claudeUpstream) Requests() []claudeRequest {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]claudeRequest(nil), u.reqs...)
}

func (u *claudeUpstream) serve(w http.ResponseWriter, r *http.Request) {
	raw, _ := io.ReadAll(r.Body)
	var body map[string]any
	_ = json.Unmarshal(raw, &body)
	u.mu.Lock()
	u.reqs = append(u.reqs, claudeRequest{Path: r.URL.Path, Key: r.Header.Get("X-Api-Key"), Version: r.Header.Get("Anthropic-Version"), Raw: raw, Body: body})
	u.mu.Unlock()
	if r.URL.Path == "/v1/messages/count_tokens" {
		_, _ = io.WriteString(w, `{"input_tokens":4242}`)
		return
	}
	msgs, _ := body["messages"].([]any)
	_, tools := body["tools"]
	block := `{"type":"text","text":` + strconv.Quote(claudeText) + `}`
	stop := "end_turn"
	if tools && len(msgs) == 1 {
		block, stop = `{"type":"tool_use","id":"toolu_1","name":"get_weather","input":{"city":"Lisbon"}}`, "tool_use"
	}
	usage := fmt.Sprintf(`"input_tokens":%d,"cache_creation_input_tokens":%d,"cache_read_input_tokens":%d`, claudeInput, claudeCacheWrite, claudeCacheRead)
	if body["stream"] != true {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"msg_1","type":"message","role":"assistant","model":%q,"content":[%s],"stop_reason":%q,"stop_sequence":null,"usage":{%s,"output_tokens":%d}}`,
			body["model"], block, stop, usage, claudeOutput)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	ev := func(name, data string) { fmt.Fprintf(w, "event: %s\ndata: %s\n\n", name, data) }
	ev("message_start", fmt.Sprintf(`{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","model":%q,"content":[],"stop_reason":null,"stop_sequence":null,"usage":{%s,"output_tokens":1}}}`, body["model"], usage))
	ev("content_block_start", `{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}`)
	ev("ping", `{"type":"ping"}`)
	for _, part := range strings.SplitAfter(claudeText, " ") {
		ev("content_block_delta", `{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":`+strconv.Quote(part)+`}}`)
	}
	ev("content_block_stop", `{"type":"content_block_stop","index":0}`)
	ev("message_delta", fmt.Sprintf(`{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":%d}}`, claudeOutput/2))
	ev("message_delta", fmt.Sprintf(`{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":%d}}`, claudeOutput))
	ev("message_stop", `{"type":"message_stop"}`)
}

// TestE2EClaudeAgent is issue #31's agent through the binary: a Claude
// agent on Anthropic's Go SDK, behind a task key, against an
// Anthropic-compatible upstream (FAREGATE_LLM_PROVIDER=anthropic). The
// delivery names the endpoint in Anthropic's terms; the models list is in
// Anthropic's shape; count_tokens is forwarded and is no model call; each
// Messages call (JSON, stream, a tool round trip) reaches the upstream
// with the key as x-api-key and every pass-through field byte for byte;
// the SDK's accumulator yields the JSON call's message; each call is on
// the ledger with the task, the principal and the cache fields, and the
// task's budget settled what the upstream reported (the prompt with its
// cache tokens), nothing outstanding.
func TestE2EClaudeAgent(t *testing.T) {
	redistest.Require(t)
	rs := redistest.Start(t)
	rdb := rs.Client(t)
	up := newClaudeUpstream(t)
	ag := newClaudeAgent(t)
	env := agentEnv(rs.URL(), ag.srv.URL, map[string]string{
		"FAREGATE_LLM_PROVIDER": "anthropic", "FAREGATE_LLM_BASE_URL": up.srv.URL + "/v1", "FAREGATE_LLM_API_KEY": "sk-ant-upstream",
		"FAREGATE_LLM_MODEL": "claude-e2e",
	})
	a := startServer(t, env)
	id := createTrip(t, a.URL, "ok")
	got, ok := pollTask(t, a.URL, id, 30*time.Second, func(m map[string]any) bool { return m["status"] == "succeeded" || m["status"] == "failed" })
	ag.mu.Lock()
	defer ag.mu.Unlock()
	for _, e := range ag.errs {
		t.Errorf("agent: %s", e)
	}
	if !ok || got["status"] != "succeeded" {
		t.Fatalf("task: %v", got)
	}
	if ag.block["base_url"] != a.URL || !strings.HasPrefix(ag.block["api_key"], "fg") || ag.block["model"] != "claude-e2e" {
		t.Fatalf("the delivery's anthropic block %v", ag.block)
	}
	if strings.Join(ag.models, ",") != "claude-e2e" || ag.count != 4242 {
		t.Fatalf("models %v, count %d", ag.models, ag.count)
	}
	if ag.json.Content[0].Text != claudeText || ag.json.StopReason != "end_turn" || ag.json.Usage.CacheReadInputTokens != claudeCacheRead {
		t.Fatalf("JSON call %+v", ag.json)
	}
	if len(ag.streamed.Content) != 1 || ag.streamed.Content[0].Text != claudeText || ag.streamed.StopReason != ag.json.StopReason ||
		ag.streamed.Usage.InputTokens != ag.json.Usage.InputTokens || ag.streamed.Usage.OutputTokens != ag.json.Usage.OutputTokens ||
		ag.streamed.Usage.CacheCreationInputTokens != claudeCacheWrite {
		t.Fatalf("the accumulated stream %+v differs from the JSON call %+v", ag.streamed, ag.json)
	}
	if ag.toolUse.StopReason != "tool_use" || ag.toolEnd.StopReason != "end_turn" {
		t.Fatalf("tool round trip: %+v then %+v", ag.toolUse, ag.toolEnd)
	}

	// What the upstream got: the key as x-api-key, a version, and the
	// body as the SDK sent it but for max_tokens (patched down to what
	// the task can afford, never up).
	reqs := up.Requests()
	var calls []claudeRequest
	for _, q := range reqs {
		if q.Key != "sk-ant-upstream" || q.Version == "" {
			t.Errorf("%s: key %q, version %q", q.Path, q.Key, q.Version)
		}
		if q.Path == "/v1/messages" {
			calls = append(calls, q)
		}
	}
	if len(calls) != 4 || len(reqs) != 5 {
		t.Fatalf("upstream requests: %d, %d of them Messages calls", len(reqs), len(calls))
	}
	for _, field := range []string{`"system":[{"text":"You plan trips.","type":"text"}]`, `"stop_sequences":["THE END"]`,
		`"temperature":0.2`, `"metadata":{"user_id":"visitor-1"}`} {
		if !bytes.Contains(calls[0].Raw, []byte(field)) || !bytes.Contains(calls[1].Raw, []byte(field)) {
			t.Errorf("the upstream's body lost %s: %s", field, calls[0].Raw)
		}
	}
	for _, q := range calls {
		if m, _ := q.Body["max_tokens"].(float64); m < 1 || m > 300 || q.Body["model"] != "claude-e2e" {
			t.Errorf("sent max_tokens %v model %v", q.Body["max_tokens"], q.Body["model"])
		}
	}

	// The ledger and the budget: one line per call, the reported prompt
	// is input + cache, settled exactly.
	rec := storedRecord(t, rdb, id)
	var lines []map[string]any
	clocktest.Eventually(t, 10*time.Second, "four ledger lines of the task", func() bool {
		lines = e2eLedger(t, rdb, rec.Day, id)
		return len(lines) >= 4
	})
	prompt := claudeInput + claudeCacheWrite + claudeCacheRead
	for _, l := range lines {
		if l["principal"] != rec.Principal || l["outcome"] != "ok" || l["prompt_tokens"] != strconv.Itoa(prompt) ||
			l["completion_tokens"] != strconv.Itoa(claudeOutput) || l["cache_read_input_tokens"] != strconv.Itoa(claudeCacheRead) ||
			l["cache_creation_input_tokens"] != strconv.Itoa(claudeCacheWrite) {
			t.Errorf("ledger line %v", l)
		}
	}
	if len(lines) != 4 {
		t.Fatalf("%d ledger lines, want 4 (count_tokens is no call)", len(lines))
	}
	u, err := budget.New(rdb, budget.Options{}).Usage(context.Background(), budget.UsageQuery{Day: rec.Day, Principal: rec.Principal, Task: rec.ID})
	if err != nil {
		t.Fatal(err)
	}
	if u.Task.Outstanding != 0 || u.Reservations != 0 || u.Task.Settled != int64(4*(prompt+claudeOutput)) {
		t.Fatalf("task scope %+v, %d open reservations; want %d settled", u.Task, u.Reservations, 4*(prompt+claudeOutput))
	}
	claudeRefusals(t, a.URL, ag.block["api_key"])
}

// claudeRefusals: what the Messages routes refuse, through the binary, in
// Anthropic's error shape with faregate's code: the key of a task that
// ended, an unknown key, a body over FAREGATE_V1_MAX_BODY, and (on a
// running task's key, which the gate checks first: the ended key answers
// 409 before the body is read) the body's own faults are the gateway's
// tests'.
func claudeRefusals(t *testing.T, base, endedKey string) {
	t.Helper()
	body := `{"model":"claude-e2e","max_tokens":10,"messages":[{"role":"user","content":"hi"}]}`
	for _, c := range []struct {
		name, key, body string
		status          int
		typ, code       string
	}{
		{"the key of a task that ended", endedKey, body, 409, "invalid_request_error", "task_finished"},
		{"an unknown key", "fgt_0123456789abcdef_NOTAKEY", body, 401, "authentication_error", "invalid_api_key"},
		{"a body over FAREGATE_V1_MAX_BODY", endedKey, `{"x":"` + strings.Repeat("a", 3<<20) + `"}`, 413, "request_too_large", "request_too_large"},
	} {
		req, _ := http.NewRequest(http.MethodPost, base+"/v1/messages?beta=true", strings.NewReader(c.body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("X-Api-Key", c.key)
		req.Header.Set("Anthropic-Version", "2023-06-01")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		raw, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		var e struct {
			Type      string `json:"type"`
			RequestID string `json:"request_id"`
			Error     struct{ Type, Code, Message string }
		}
		if err := json.Unmarshal(raw, &e); err != nil || resp.StatusCode != c.status || e.Type != "error" || e.Error.Type != c.typ ||
			e.Error.Code != c.code || e.Error.Message == "" || e.RequestID == "" || resp.Header.Get("Request-Id") != e.RequestID {
			t.Errorf("%s: %d %s (Request-Id %q), want %d %s/%s in Anthropic's shape", c.name, resp.StatusCode, raw, resp.Header.Get("Request-Id"), c.status, c.typ, c.code)
		}
	}
}

// TestE2EClaudeAgentOffline: the same agent on the embedded defaults'
// offline model (FAREGATE_LLM_PROVIDER=openai, the default): its Messages
// calls are translated to chat completions and back, the stream event by
// event, and the SDK reads them; count_tokens is faregate's estimate.
func TestE2EClaudeAgentOffline(t *testing.T) {
	redistest.Require(t)
	rs := redistest.Start(t)
	ag := newClaudeAgent(t)
	a := startServer(t, agentEnv(rs.URL(), ag.srv.URL, nil))
	id := createTrip(t, a.URL, "ok")
	got, ok := pollTask(t, a.URL, id, 30*time.Second, func(m map[string]any) bool { return m["status"] == "succeeded" || m["status"] == "failed" })
	ag.mu.Lock()
	defer ag.mu.Unlock()
	for _, e := range ag.errs {
		t.Errorf("agent: %s", e)
	}
	if !ok || got["status"] != "succeeded" {
		t.Fatalf("task: %v", got)
	}
	if ag.count <= 0 || len(ag.models) == 0 || ag.models[0] != ag.block["model"] {
		t.Fatalf("count %d, models %v, delivery %v", ag.count, ag.models, ag.block)
	}
	if len(ag.json.Content) == 0 || ag.json.Content[0].Text == "" || ag.json.Usage.OutputTokens <= 0 {
		t.Fatalf("JSON call %+v", ag.json)
	}
	var a1, a2 string
	for _, c := range ag.json.Content {
		a1 += c.Text
	}
	for _, c := range ag.streamed.Content {
		a2 += c.Text
	}
	if a1 != a2 || ag.streamed.StopReason != ag.json.StopReason {
		t.Fatalf("the offline model streamed %q (%s), answered %q (%s)", a2, ag.streamed.StopReason, a1, ag.json.StopReason)
	}
}
