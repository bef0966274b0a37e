package gateway

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/anthropics/anthropic-sdk-go/v2"
	"github.com/anthropics/anthropic-sdk-go/v2/option"

	"faregate/agent/govern"
	"faregate/agent/offline"
)

// TestMessagesPassThroughSDK: through Anthropic's Go SDK, a JSON call and
// a streamed one against an Anthropic upstream yield the same message (the
// SDK's accumulator over the relayed stream equals the relayed answer),
// thinking, text and tool_use blocks alike; the governor is told the
// provider's usage with the cache parts apart and the prompt their sum.
func TestMessagesPassThroughSDK(t *testing.T) {
	up := newAnthropicUpstream(t, func(w http.ResponseWriter, r *http.Request, body map[string]any) {
		if r.URL.Path != "/v1/messages" {
			t.Errorf("upstream path %s", r.URL.Path)
		}
		if body["stream"] == true {
			sse(w, msgStream()...)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, msgAnswerJSON)
	})
	e := newMsgEnv(t, up.upstream(), WireAnthropic, nil)
	params := userText("Weather in Lisbon?")
	whole, err := e.client.Messages.New(t.Context(), params)
	if err != nil {
		t.Fatal(err)
	}
	_, _, jsonOut, _ := e.gov.last(t)
	streamed, err := accumulate(t, e, params)
	if err != nil {
		t.Fatal(err)
	}
	sameMessage(t, "stream and JSON", streamed, whole)
	if whole.Content[2].Name != "get_weather" || string(whole.Content[2].Input) != `{"city":"Lisbon"}` {
		t.Fatalf("tool_use %+v", whole.Content[2])
	}
	spec, _, out, err := e.gov.last(t)
	if err != nil || spec.Kind != KindMessages || spec.MaxOutput != 1000 || spec.MinOutput != 1 {
		t.Fatalf("spec %+v, err %v", spec, err)
	}
	want := govern.Usage{Prompt: 12 + 100 + 2000, Completion: 40, Reported: true, CacheCreation: 100, CacheRead: 2000}
	for _, o := range []govern.Outcome{jsonOut, out} {
		got := o.Usage
		got.Raw = ""
		if got != want || o.Counted == 0 || o.Truncated || !o.Started {
			t.Fatalf("outcome %+v, want usage %+v", o, want)
		}
	}
}

// TestMessagesStreamCutAtLimit: a stream longer than the attempt's output
// limit is cut where the count passes it and ends as the SDKs expect: the
// open block's content_block_stop, message_delta with stop_reason
// max_tokens and the usage (the provider's prompt, what passed), then
// message_stop; the SDK's accumulator takes it.
func TestMessagesStreamCutAtLimit(t *testing.T) {
	up := newAnthropicUpstream(t, func(w http.ResponseWriter, r *http.Request, body map[string]any) {
		evs := msgStream()[:1]
		evs = append(evs, event(map[string]any{"type": "content_block_start", "index": 0, "content_block": map[string]any{"type": "text", "text": ""}}))
		for range 400 {
			evs = append(evs, event(map[string]any{"type": "content_block_delta", "index": 0, "delta": map[string]any{"type": "text_delta", "text": "again and "}}))
		}
		sse(w, evs...)
	})
	e := newMsgEnv(t, up.upstream(), WireAnthropic, nil)
	e.gov.cap = 50
	resp, raw := e.post(t, "/v1/messages", `{"model":"`+claudeModel+`","max_tokens":4000,"stream":true,"messages":[{"role":"user","content":"go"}]}`)
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, raw)
	}
	names, data := sseEvents(t, raw)
	n := len(names)
	if n < 4 || strings.Join(names[n-3:], ",") != "content_block_stop,message_delta,message_stop" {
		t.Fatalf("the stream ends %v", names[max(n-4, 0):])
	}
	md := data[n-2]
	if md["delta"].(map[string]any)["stop_reason"] != "max_tokens" {
		t.Fatalf("message_delta %v", md)
	}
	usage := md["usage"].(map[string]any)
	_, a, out, _ := e.gov.last(t)
	if a.MaxOutput != 50 || !out.Truncated || out.Counted > 50 || out.Counted < 40 || usage["output_tokens"] != float64(out.Counted) ||
		usage["input_tokens"] != float64(12) || usage["cache_read_input_tokens"] != float64(2000) {
		t.Fatalf("attempt %+v, outcome %+v, usage sent %v", a, out, usage)
	}
	if got := up.lastBody(t)["max_tokens"]; got != float64(50) {
		t.Fatalf("sent max_tokens %v, want the attempt's 50", got)
	}
	msg, err := accumulate(t, e, userText("go"))
	if err != nil || msg.StopReason != "max_tokens" || !strings.HasPrefix(msg.Content[0].Text, "again and again") {
		t.Fatalf("SDK: %v %+v", err, msg)
	}
}

// TestMessagesTranslatedOffline: against the offline model (chat
// completions), the SDK's JSON call and streamed call come back as
// Messages, the accumulator's message equal to the JSON one.
func TestMessagesTranslatedOffline(t *testing.T) {
	e := newMsgEnv(t, offlineUpstream(), WireOpenAI, nil)
	params := anthropic.MessageNewParams{Model: offline.ModelName, MaxTokens: 800,
		System:   []anthropic.TextBlockParam{{Text: "You plan trips."}},
		Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Three days in Lisbon, food."))}}
	whole, err := e.client.Messages.New(t.Context(), params)
	if err != nil {
		t.Fatal(err)
	}
	if len(whole.Content) == 0 || whole.Content[0].Type != "text" || !strings.Contains(strings.ToLower(whole.Content[0].Text), "offline") ||
		whole.StopReason != "end_turn" || whole.Usage.InputTokens == 0 || whole.Usage.OutputTokens == 0 {
		t.Fatalf("JSON: %+v", whole)
	}
	streamed, err := accumulate(t, e, params)
	if err != nil {
		t.Fatal(err)
	}
	// The ids differ (each call is its own); the rest must not.
	sameMessage(t, "offline stream and JSON", streamed, whole)
}

// chatToolUpstream is an OpenAI-compatible provider that asks for a tool
// first and answers with the tool's result once it has it, in JSON or a
// stream as asked, with usage.
func chatToolUpstream(t *testing.T) *scripted {
	return newScripted(t, func(w http.ResponseWriter, r *http.Request, body map[string]any) {
		msgs, _ := body["messages"].([]any)
		last, _ := msgs[len(msgs)-1].(map[string]any)
		stream := body["stream"] == true
		if last["role"] == "tool" {
			text := "It is " + last["content"].(string) + " in Lisbon."
			if stream {
				sse(w, chunkJSON("It is "), chunkJSON(last["content"].(string)+" in Lisbon."),
					`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}`,
					`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[],"usage":{"prompt_tokens":60,"completion_tokens":9,"total_tokens":69}}`,
					"data: [DONE]")
				return
			}
			b, _ := json.Marshal(map[string]any{"id": "c2", "object": "chat.completion", "model": "gpt-4o-mini",
				"choices": []any{map[string]any{"index": 0, "finish_reason": "stop", "message": map[string]any{"role": "assistant", "content": text}}},
				"usage":   map[string]any{"prompt_tokens": 60, "completion_tokens": 9, "total_tokens": 69}})
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write(b)
			return
		}
		if stream {
			sse(w,
				`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{"role":"assistant","reasoning_content":"Need the weather."},"finish_reason":null}]}`,
				`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{"content":"Checking."},"finish_reason":null}]}`,
				`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"get_weather","arguments":""}}]},"finish_reason":null}]}`,
				`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"city\":"}}]},"finish_reason":null}]}`,
				`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\"Lisbon\"}"}}]},"finish_reason":null}]}`,
				`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}`,
				`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[],"usage":{"prompt_tokens":50,"completion_tokens":20,"total_tokens":70}}`,
				"data: [DONE]")
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"c1","object":"chat.completion","model":"gpt-4o-mini","choices":[{"index":0,"finish_reason":"tool_calls",
"message":{"role":"assistant","reasoning_content":"Need the weather.","content":"Checking.","tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Lisbon\"}"}}]}}],
"usage":{"prompt_tokens":50,"completion_tokens":20,"total_tokens":70}}`)
	})
}

// TestMessagesTranslatedToolRoundTrip: a custom tool's round trip
// through the SDK against an OpenAI-compatible upstream, JSON and
// streamed: the tool call comes back as a tool_use block (reasoning as a
// thinking block, stop_reason tool_use), the accumulator's message equal
// to the JSON one; the tool_result goes upstream as a tool message after
// the assistant's tool call, and the answer quotes it.
func TestMessagesTranslatedToolRoundTrip(t *testing.T) {
	up := chatToolUpstream(t)
	e := newMsgEnv(t, up.upstream(), WireOpenAI, nil)
	// The Go SDK has no temperature of its own; Python's and TypeScript's do.
	e.client = anthropic.NewClient(option.WithBaseURL(e.srv.URL), option.WithAPIKey("fgt_test"), option.WithMaxRetries(0),
		option.WithJSONSet("temperature", 0.2))
	tool := anthropic.ToolUnionParam{OfTool: &anthropic.ToolParam{Name: "get_weather", Description: anthropic.String("The weather of a city."),
		InputSchema: anthropic.ToolInputSchemaParam{Properties: map[string]any{"city": map[string]any{"type": "string"}}, Required: []string{"city"}}}}
	params := anthropic.MessageNewParams{Model: testModel, MaxTokens: 500, Tools: []anthropic.ToolUnionParam{tool},
		StopSequences: []string{"END"},
		ToolChoice:    anthropic.ToolChoiceUnionParam{OfAny: &anthropic.ToolChoiceAnyParam{DisableParallelToolUse: anthropic.Bool(true)}},
		Messages:      []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Weather in Lisbon?"))}}
	whole, err := e.client.Messages.New(t.Context(), params)
	if err != nil {
		t.Fatal(err)
	}
	streamed, err := accumulate(t, e, params)
	if err != nil {
		t.Fatal(err)
	}
	sameMessage(t, "tool call: stream and JSON", streamed, whole)
	if len(whole.Content) != 3 || whole.Content[0].Thinking != "Need the weather." || whole.Content[1].Text != "Checking." ||
		whole.Content[2].Type != "tool_use" || whole.Content[2].ID != "call_1" || whole.StopReason != "tool_use" ||
		whole.Usage.InputTokens != 50 || whole.Usage.OutputTokens != 20 {
		t.Fatalf("tool call: %+v", whole)
	}
	sent := up.lastBody(t)
	tools, _ := json.Marshal(sent["tools"])
	if string(tools) != `[{"function":{"description":"The weather of a city.","name":"get_weather","parameters":{"properties":{"city":{"type":"string"}},"required":["city"],"type":"object"}},"type":"function"}]` ||
		sent["tool_choice"] != "required" || sent["parallel_tool_calls"] != false || sent["temperature"] != 0.2 ||
		sent["stream_options"].(map[string]any)["include_usage"] != true {
		t.Fatalf("translated request %s", tools)
	}
	if stop, _ := json.Marshal(sent["stop"]); string(stop) != `["END"]` {
		t.Fatalf("stop %s", stop)
	}
	// The round trip: the assistant's turn as the SDK returns it, then
	// the tool's result.
	params.Messages = append(params.Messages, whole.ToParam(),
		anthropic.NewUserMessage(anthropic.NewToolResultBlock("call_1", "21°C and sunny", false)))
	params.ToolChoice = anthropic.ToolChoiceUnionParam{}
	for _, stream := range []bool{false, true} {
		var final *anthropic.Message
		if stream {
			final, err = accumulate(t, e, params)
		} else {
			final, err = e.client.Messages.New(t.Context(), params)
		}
		if err != nil || final.Content[0].Text != "It is 21°C and sunny in Lisbon." || final.StopReason != "end_turn" {
			t.Fatalf("stream %v: %v %+v", stream, err, final)
		}
		msgs := up.lastBody(t)["messages"].([]any)
		asst, tool := msgs[1].(map[string]any), msgs[2].(map[string]any)
		calls, _ := json.Marshal(asst["tool_calls"])
		if asst["role"] != "assistant" || asst["content"] != "Checking." || tool["role"] != "tool" || tool["tool_call_id"] != "call_1" ||
			string(calls) != `[{"function":{"arguments":"{\"city\":\"Lisbon\"}","name":"get_weather"},"id":"call_1","type":"function"}]` {
			t.Fatalf("stream %v: the tool round trip went upstream as %v", stream, msgs)
		}
	}
}

// TestMessagesModelsAndCount: the models list and one model in
// Anthropic's shape through the SDK; count_tokens answered from the
// estimate with an OpenAI upstream (the prompt a call of the same body is
// reserved for) and forwarded with an Anthropic one, neither a governed
// call.
func TestMessagesModelsAndCount(t *testing.T) {
	up := newAnthropicUpstream(t, func(w http.ResponseWriter, r *http.Request, body map[string]any) {
		if r.URL.Path != "/v1/messages/count_tokens" || r.Header.Get("X-Api-Key") != "sk-upstream" {
			t.Errorf("count_tokens went to %s with key %q", r.URL.Path, r.Header.Get("X-Api-Key"))
		}
		_, _ = io.WriteString(w, `{"input_tokens": 4242}`)
	})
	for _, wire := range []string{WireOpenAI, WireAnthropic} {
		e := newMsgEnv(t, up.upstream(), wire, func(_ *Options, mo *MessagesOptions) {
			u := up.upstream()
			mo.CountUpstream = &u
		})
		page, err := e.client.Models.List(t.Context(), anthropic.ModelListParams{})
		if err != nil || len(page.Data) != 3 || page.Data[0].ID != claudeModel || page.Data[0].Type != "model" || page.HasMore ||
			page.FirstID != claudeModel || page.LastID != offline.ModelName {
			t.Fatalf("%s: models %v %+v", wire, err, page)
		}
		one, err := e.client.Models.Get(t.Context(), testModel, anthropic.ModelGetParams{})
		if err != nil || one.ID != testModel || one.DisplayName != testModel {
			t.Fatalf("%s: model %v %+v", wire, err, one)
		}
		var apiErr *anthropic.Error
		if _, err := e.client.Models.Get(t.Context(), "claude-opus-4", anthropic.ModelGetParams{}); !errors.As(err, &apiErr) || apiErr.StatusCode != 404 {
			t.Fatalf("%s: an unknown model: %v", wire, err)
		}
		params := anthropic.MessageCountTokensParams{Model: claudeModel,
			Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("How many tokens is this?"))}}
		n, err := e.client.Messages.CountTokens(t.Context(), params)
		if err != nil {
			t.Fatal(err)
		}
		if wire == WireAnthropic && n.InputTokens != 4242 {
			t.Fatalf("forwarded count %d", n.InputTokens)
		}
		if wire == WireOpenAI {
			m, err := parseMessages([]byte(`{"model":"`+claudeModel+`","max_tokens":5,"messages":[{"role":"user","content":[{"type":"text","text":"How many tokens is this?"}]}]}`), anyModel, false)
			if err != nil || n.InputTokens != m.prompt {
				t.Fatalf("estimated count %d, want the reserved prompt %d (%v)", n.InputTokens, m.prompt, err)
			}
		}
		if len(e.gov.specs) != 0 {
			t.Fatalf("%s: count_tokens and models reached the governor", wire)
		}
	}
}
