package gateway

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"faregate/agent/govern"
	"faregate/agent/tokens"
)

func okMessages(t *testing.T) *anthropicUpstream {
	return newAnthropicUpstream(t, func(w http.ResponseWriter, r *http.Request, body map[string]any) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, msgAnswerJSON)
	})
}

// anthropicErrorOf reads an error answer in Anthropic's shape.
func anthropicErrorOf(t *testing.T, body string) (typ, code, message, requestID string) {
	t.Helper()
	var e struct {
		Type  string `json:"type"`
		Error struct {
			Type, Message, Code string
		} `json:"error"`
		RequestID string `json:"request_id"`
	}
	if err := json.Unmarshal([]byte(body), &e); err != nil || e.Type != "error" {
		t.Fatalf("not an Anthropic error: %q", body)
	}
	return e.Error.Type, e.Error.Code, e.Error.Message, e.RequestID
}

// TestMessagesRefused: every bad or cost-changing request is refused in
// Anthropic's error shape, with faregate's code and the field named,
// before the governor or the provider hears of it.
func TestMessagesRefused(t *testing.T) {
	up := okMessages(t)
	e := newMsgEnv(t, up.upstream(), WireAnthropic, nil)
	head := `"model":"` + claudeModel + `","max_tokens":100`
	user := `"messages":[{"role":"user","content":"hi"}]`
	ok := `{` + head + `,` + user
	blocks := func(b string) string {
		return `{` + head + `,"messages":[{"role":"user","content":[` + b + `]}]}`
	}
	cases := []struct {
		name, body string
		header     []string
		status     int
		code, typ  string
		field      string // the message names it
	}{
		{"no max_tokens", `{"model":"` + claudeModel + `",` + user + `}`, nil, 400, "invalid_request", "invalid_request_error", "max_tokens"},
		{"max_tokens zero", `{"model":"` + claudeModel + `","max_tokens":0,` + user + `}`, nil, 400, "invalid_request", "invalid_request_error", "max_tokens"},
		{"max_tokens negative", `{"model":"` + claudeModel + `","max_tokens":-5,` + user + `}`, nil, 400, "invalid_request", "invalid_request_error", "max_tokens"},
		{"max_tokens fraction", `{"model":"` + claudeModel + `","max_tokens":10.5,` + user + `}`, nil, 400, "invalid_request", "invalid_request_error", "max_tokens"},
		{"max_tokens text", `{"model":"` + claudeModel + `","max_tokens":"10",` + user + `}`, nil, 400, "invalid_request", "invalid_request_error", "max_tokens"},
		{"max_tokens above 2^40", `{"model":"` + claudeModel + `","max_tokens":1099511627777,` + user + `}`, nil, 400, "invalid_request", "invalid_request_error", "max_tokens"},
		{"max_tokens 1e300", `{"model":"` + claudeModel + `","max_tokens":1e300,` + user + `}`, nil, 400, "invalid_request", "invalid_request_error", "max_tokens"},
		{"malformed JSON", `{"model":`, nil, 400, "invalid_request", "invalid_request_error", "body"},
		{"not an object", `[1]`, nil, 400, "invalid_request", "invalid_request_error", "body"},
		{"model twice", ok + `,"model":"claude-opus-4"}`, nil, 400, "invalid_request", "invalid_request_error", "model"},
		{"max_tokens folded", ok + `,"MAX_TOKENS":100000}`, nil, 400, "invalid_request", "invalid_request_error", "MAX_TOKENS"},
		{"system spelled otherwise", ok + `,"System":"x"}`, nil, 400, "invalid_request", "invalid_request_error", "System"},
		{"a block member folded", blocks(`{"type":"text","text":"hi","Text":"a long text"}`), nil, 400, "invalid_request", "invalid_request_error", "messages[0].content[0]"},
		{"no messages", `{` + head + `}`, nil, 400, "invalid_request", "invalid_request_error", "messages"},
		{"unknown model", `{"model":"claude-opus-4","max_tokens":100,` + user + `}`, nil, 400, "model_not_allowed", "invalid_request_error", ""},
		{"web search", ok + `,"tools":[{"name":"f","input_schema":{"type":"object"}},{"type":"web_search_20250305","name":"web_search"}]}`, nil, 400, "unsupported_parameter", "invalid_request_error", "tools[1].type"},
		{"web fetch", ok + `,"tools":[{"type":"web_fetch_20250910","name":"web_fetch"}]}`, nil, 400, "unsupported_parameter", "invalid_request_error", "tools[0].type"},
		{"code execution", ok + `,"tools":[{"type":"code_execution_20250825","name":"code_execution"}]}`, nil, 400, "unsupported_parameter", "invalid_request_error", "tools[0].type"},
		{"bash", ok + `,"tools":[{"type":"bash_20250124","name":"bash"}]}`, nil, 400, "unsupported_parameter", "invalid_request_error", "tools[0].type"},
		{"mcp_servers", ok + `,"mcp_servers":[{"type":"url","url":"https://x","name":"x"}]}`, nil, 400, "unsupported_parameter", "invalid_request_error", "mcp_servers"},
		{"container", ok + `,"container":"cntr_1"}`, nil, 400, "unsupported_parameter", "invalid_request_error", "container"},
		{"fast mode", ok + `,"speed":"fast"}`, nil, 400, "unsupported_parameter", "invalid_request_error", "speed"},
		{"regional inference", ok + `,"inference_geo":"us"}`, nil, 400, "unsupported_parameter", "invalid_request_error", "inference_geo"},
		{"priority tier", ok + `,"service_tier":"priority"}`, nil, 400, "unsupported_parameter", "invalid_request_error", "service_tier"},
		{"an image by file_id", blocks(`{"type":"image","source":{"type":"file","file_id":"file_1"}}`), nil, 400, "unsupported_parameter", "invalid_request_error", "messages[0].content[0].source.file_id"},
		{"a document by file_id", blocks(`{"type":"text","text":"sum up"},{"type":"document","source":{"type":"file","file_id":"file_1"}}`), nil, 400, "unsupported_parameter", "invalid_request_error", "messages[0].content[1].source.file_id"},
		{"a document by URL", blocks(`{"type":"document","source":{"type":"url","url":"https://x/a.pdf"}}`), nil, 400, "unsupported_parameter", "invalid_request_error", "messages[0].content[0].source.url"},
		{"a file in a tool result", blocks(`{"type":"tool_result","tool_use_id":"t","content":[{"type":"document","source":{"type":"file","file_id":"f"}}]}`), nil, 400, "unsupported_parameter", "invalid_request_error", "messages[0].content[0].content[0].source.file_id"},
		{"a container upload", blocks(`{"type":"container_upload","file_id":"file_1"}`), nil, 400, "unsupported_parameter", "invalid_request_error", "messages[0].content[0].file_id"},
		{"thinking budget below 1024", `{` + head[:len(head)-3] + `2000,` + user + `,"thinking":{"type":"enabled","budget_tokens":500}}`, nil, 400, "invalid_request", "invalid_request_error", "thinking.budget_tokens"},
		{"thinking without room", ok + `,"thinking":{"type":"enabled","budget_tokens":1024}}`, nil, 400, "invalid_request", "invalid_request_error", "max_tokens"},
		{"thinking of another type", ok + `,"thinking":{"type":"extended"}}`, nil, 400, "unsupported_parameter", "invalid_request_error", "thinking.type"},
		{"thinking budget folded", ok + `,"thinking":{"type":"enabled","Budget_Tokens":2000}}`, nil, 400, "invalid_request", "invalid_request_error", "thinking.Budget_Tokens"},
		{"the 1M context beta", ok + `}`, []string{"anthropic-beta", "interleaved-thinking-2025-05-14,context-1m-2025-08-07"}, 400, "unsupported_parameter", "invalid_request_error", "anthropic-beta"},
		{"fast mode beta", ok + `}`, []string{"anthropic-beta", "fast-mode-2026-02-01"}, 400, "unsupported_parameter", "invalid_request_error", "anthropic-beta"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r, body := e.post(t, "/v1/messages", c.body, c.header...)
			typ, code, msg, rid := anthropicErrorOf(t, body)
			if r.StatusCode != c.status || code != c.code || typ != c.typ || rid != "req_test" || !strings.Contains(msg, c.field) {
				t.Fatalf("got %d %s %s %q, want %d %s %s naming %q", r.StatusCode, code, typ, msg, c.status, c.code, c.typ, c.field)
			}
		})
	}
	// Allowed values of the same fields pass.
	for _, body := range []string{
		ok + `,"tools":[{"name":"f","input_schema":{"type":"object"}},{"type":"custom","name":"g","input_schema":{"type":"object"}},{"type":null,"name":"h","input_schema":{}}]}`,
		ok + `,"mcp_servers":[],"speed":"standard","inference_geo":"global","service_tier":"standard_only","thinking":{"type":"adaptive"}}`,
		`{"model":"` + claudeModel + `","max_tokens":2000,` + user + `,"thinking":{"type":"enabled","budget_tokens":1024}}`,
		blocks(`{"type":"image","source":{"type":"url","url":"https://x/a.png"}},{"type":"document","source":{"type":"text","media_type":"text/plain","data":"notes"}}`),
	} {
		if r, b := e.post(t, "/v1/messages", body, "anthropic-beta", "interleaved-thinking-2025-05-14"); r.StatusCode != 200 {
			t.Fatalf("%s: %d %s", body, r.StatusCode, b)
		}
	}
	if n := len(e.gov.specs); n != 4 {
		t.Fatalf("the governor heard of %d calls, want only the 4 allowed ones", n)
	}
}

// passedMessages are the Messages request fields forwarded byte for byte
// to an Anthropic upstream (as is any field not known here): the list the
// package doc gives. Governed, and so rewritten: model, max_tokens,
// thinking's budget_tokens; refused: TestMessagesRefused's.
var passedMessages = []string{
	`"messages":[{"role":"user","content":[{"type":"text","text":"hi","cache_control":{"type":"ephemeral","ttl":"1h"}}]},{"role":"assistant","content":[{"type":"tool_use","id":"toolu_1","name":"get_weather","input":{"City":"Lisbon"}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":"sunny","is_error":false}]}]`,
	`"system":[{"type":"text","text":"Be brief.","cache_control":{"type":"ephemeral"}}]`,
	`"tools":[{"name":"get_weather","description":"Weather.","input_schema":{"type":"object","properties":{"city":{"type":"string"}},"additionalProperties":false},"strict":true}]`,
	`"tool_choice":{"type":"tool","name":"get_weather","disable_parallel_tool_use":true}`,
	`"metadata":{"user_id":"u-1"}`, `"stop_sequences":["\n\nHuman:","END"]`, `"temperature":0.2`, `"top_p":0.9`, `"top_k":40`,
	`"cache_control":{"type":"ephemeral"}`, `"output_config":{"effort":"low"}`, `"service_tier":"auto"`,
	`"stream":false`, `"x_vendor_field":{"keep":[1,2,3]}`,
}

// TestMessagesFieldsPassUntouched: every field of passedMessages reaches
// an Anthropic upstream exactly as the client wrote it; model, max_tokens
// and budget_tokens carry the attempt's values; the key goes as x-api-key
// with the client's anthropic-version and anthropic-beta.
func TestMessagesFieldsPassUntouched(t *testing.T) {
	up := okMessages(t)
	e := newMsgEnv(t, up.upstream(), WireAnthropic, nil)
	e.gov.cap, e.gov.model = 3000, "claude-sonnet-4-5-20250929"
	body := `{"model":"` + claudeModel + `","max_tokens":64000,"thinking":{"type":"enabled","budget_tokens":32000,"display":"summarized"},` +
		strings.Join(passedMessages, ",") + `}`
	if r, b := e.post(t, "/v1/messages?beta=true", body, "anthropic-version", "2023-06-01", "anthropic-beta", "interleaved-thinking-2025-05-14"); r.StatusCode != 200 {
		t.Fatalf("%d %s", r.StatusCode, b)
	}
	raw := up.raw(t, 0)
	for _, f := range append(passedMessages, `"model":"claude-sonnet-4-5-20250929"`, `"max_tokens":3000`,
		`"thinking":{"type":"enabled","budget_tokens":2999,"display":"summarized"}`) {
		if !strings.Contains(raw, f) {
			t.Errorf("%s did not arrive as sent; the provider got %s", f, raw)
		}
	}
	h := up.headers[0]
	if h.Get("X-Api-Key") != "sk-upstream" || h.Get("Authorization") != "" || h.Get("Anthropic-Version") != "2023-06-01" ||
		h.Get("Anthropic-Beta") != "interleaved-thinking-2025-05-14" || up.srv.URL == "" {
		t.Fatalf("headers %v", h)
	}
	spec, _, _, _ := e.gov.last(t)
	if spec.MinOutput != MinThinkingBudget+1 || spec.MaxOutput != 64000 {
		t.Fatalf("spec %+v: manual thinking is reserved with room for 1,024 thinking tokens", spec)
	}
}

// TestMessagesThinkingRule: thinking's budget is held below the output
// limit the attempt was granted, never below 1,024; an attempt granted
// less than MinOutput is refused rather than sent (a governor that did
// not apply MinOutput), and an OpenAI-compatible upstream, which is sent
// no thinking, needs no room for it.
func TestMessagesThinkingRule(t *testing.T) {
	m, err := parseMessages([]byte(`{"model":"m","max_tokens":10000,"messages":[],"thinking":{"type":"enabled","budget_tokens":8000}}`), anyModel, false)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		limit, want int64
		ok          bool
	}{{20000, 8000, true}, {8000, 7999, true}, {1025, 1024, true}, {1024, 0, false}, {1, 0, false}} {
		b, err := m.anthropicBody(govern.Attempt{Model: govern.Model{Name: "m"}, MaxOutput: c.limit})
		if !c.ok {
			if err == nil {
				t.Fatalf("limit %d: sent %s", c.limit, b)
			}
			continue
		}
		if want := fmt.Sprintf(`"thinking":{"type":"enabled","budget_tokens":%d}`, c.want); err != nil || !strings.Contains(string(b), want) {
			t.Fatalf("limit %d: %v %s, want %s", c.limit, err, b, want)
		}
	}
	if m.minOutput(WireAnthropic) != 1025 || m.minOutput(WireOpenAI) != 1 {
		t.Fatalf("minOutput %d %d", m.minOutput(WireAnthropic), m.minOutput(WireOpenAI))
	}
	c, err := m.chatCall()
	if err != nil || strings.Contains(string(c.body(govern.Attempt{Model: govern.Model{Name: "m"}, MaxOutput: 500}, false)), "thinking") {
		t.Fatalf("the translated call carries thinking: %v", err)
	}
}

// TestMessagesPromptCount: a Messages prompt counts as the chat request
// it translates to (the chat route's rules: the same messages, tool calls,
// tool results and tools), whichever tokenizer the model has; images are
// held at their allowance; a system prompt's blocks and a tool result's
// blocks are read.
func TestMessagesPromptCount(t *testing.T) {
	body := `{"model":"%s","max_tokens":100,"system":"You plan trips in Portugal.",
"tools":[{"name":"get_weather","description":"The weather of a city.","input_schema":{"type":"object","properties":{"city":{"type":"string"}}}}],
"messages":[{"role":"user","content":"Three days in Lisbon, what should I pack?"},
{"role":"assistant","content":[{"type":"text","text":"Let me check the weather."},{"type":"tool_use","id":"toolu_1","name":"get_weather","input":{"city":"Lisbon"}}]},
{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":"21°C, sunny, a breeze in the evening"},{"type":"text","text":"Thanks!"}]}]}`
	for _, model := range []string{testModel, claudeModel} {
		m, err := parseMessages(fmt.Appendf(nil, body, model), anyModel, false)
		if err != nil {
			t.Fatal(err)
		}
		cb, err := m.chatBody()
		if err != nil {
			t.Fatal(err)
		}
		c, err := parseCall(KindChat, cb, anyModel)
		if err != nil {
			t.Fatal(err)
		}
		if m.prompt != c.prompt || m.prompt < 60 {
			t.Fatalf("%s: Messages prompt %d, its chat request's %d", model, m.prompt, c.prompt)
		}
	}
	img := `{"model":"` + claudeModel + `","max_tokens":100,"system":[{"type":"text","text":"Describe."}],"messages":[{"role":"user","content":[
{"type":"image","source":{"type":"base64","media_type":"image/png","data":"iVBORw0KGgo="}},
{"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"result text"},{"type":"image","source":{"type":"url","url":"https://x/b.png"}}]}]}]}`
	m, err := parseMessages([]byte(img), anyModel, false)
	if err != nil {
		t.Fatal(err)
	}
	if m.images != 2 || m.prompt < 2*tokens.ImageTokens(claudeModel, false) {
		t.Fatalf("two images: %d counted, prompt %d", m.images, m.prompt)
	}
}
