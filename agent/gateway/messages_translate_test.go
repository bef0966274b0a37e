package gateway

import (
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"

	"faregate/agent/tasklimits"
)

// TestMessagesTranslatedCutAndBreak: a translated stream is cut at the
// attempt's output limit as a pass-through one is (the open block
// stopped, message_delta max_tokens with the usage, message_stop), and a
// chat stream that breaks after it began ends with event: error; both
// well formed for the SDK.
func TestMessagesTranslatedCutAndBreak(t *testing.T) {
	t.Run("cut", func(t *testing.T) {
		up := newScripted(t, endless("and again "))
		e := newMsgEnv(t, up.upstream(), WireOpenAI, nil)
		e.gov.cap = 40
		msg, err := accumulate(t, e, userText("go"))
		if err != nil || msg.StopReason != "max_tokens" || !strings.HasPrefix(msg.Content[0].Text, "and again and again") {
			t.Fatalf("%v %+v", err, msg)
		}
		_, _, out, _ := e.gov.last(t)
		if !out.Truncated || out.Counted > 40 || out.Counted < 30 || msg.Usage.OutputTokens != out.Counted || msg.Usage.InputTokens != out.Usage.Prompt {
			t.Fatalf("outcome %+v, usage sent %+v", out, msg.Usage)
		}
	})
	t.Run("broken", func(t *testing.T) {
		up := newScripted(t, func(w http.ResponseWriter, _ *http.Request, _ map[string]any) {
			sse(w, chunkJSON("Half an "), chunkJSON("answer"))
		})
		e := newMsgEnv(t, up.upstream(), WireOpenAI, nil)
		resp, raw := e.post(t, "/v1/messages", `{"model":"`+claudeModel+`","max_tokens":100,"stream":true,"messages":[{"role":"user","content":"go"}]}`)
		names, data := sseEvents(t, raw)
		if resp.StatusCode != 200 || names[len(names)-1] != "error" || data[len(data)-1]["error"].(map[string]any)["code"] != "model_unavailable" {
			t.Fatalf("%d %s", resp.StatusCode, raw)
		}
		if _, err := accumulateRaw(t, raw); err == nil {
			t.Fatal("a broken stream read as whole")
		}
		if _, _, out, err := e.gov.last(t); !errors.Is(err, ErrUpstream) || !out.Started || out.Counted == 0 {
			t.Fatalf("outcome %+v %v", out, err)
		}
	})
}

// TestMessagesTranslatedAnswers: a chat answer's parts become a Messages
// answer's: finish_reason to stop_reason, tool arguments that are not a
// JSON object to an empty input (their text still counted), a refusal to
// text, usage mapped; an answer that is no chat result is the provider's
// failure.
func TestMessagesTranslatedAnswers(t *testing.T) {
	for finish, want := range map[string]string{"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
		"function_call": "tool_use", "content_filter": "refusal", "": "end_turn"} {
		if got := stopReasonOf(finish); got != want {
			t.Errorf("finish_reason %q: stop_reason %q, want %q", finish, got, want)
		}
	}
	answer := `{"id":"c9","object":"chat.completion","model":"m","choices":[{"index":0,"finish_reason":"content_filter","message":{"role":"assistant","refusal":"I can't help with that.",
"tool_calls":[{"id":"call_9","type":"function","function":{"name":"f","arguments":"not json at all, a long text"}}]}}],"usage":{"prompt_tokens":7,"completion_tokens":30,"total_tokens":37}}`
	up := newScripted(t, func(w http.ResponseWriter, r *http.Request, body map[string]any) {
		w.Header().Set("Content-Type", "application/json")
		if body["messages"].([]any)[0].(map[string]any)["content"] == "bad" {
			_, _ = io.WriteString(w, `{"error":{"message":"provider secret"}}`)
			return
		}
		_, _ = io.WriteString(w, answer)
	})
	e := newMsgEnv(t, up.upstream(), WireOpenAI, nil)
	msg, err := e.client.Messages.New(t.Context(), userText("go"))
	if err != nil {
		t.Fatal(err)
	}
	if msg.StopReason != "refusal" || msg.Content[0].Text != "I can't help with that." || string(msg.Content[1].Input) != "{}" ||
		msg.Usage.InputTokens != 7 || msg.Usage.OutputTokens != 30 {
		t.Fatalf("%+v", msg)
	}
	if _, _, out, _ := e.gov.last(t); out.Counted < newOutCounterOf("", "not json at all, a long text") {
		t.Fatalf("the broken arguments were not counted: %+v", out)
	}
	r, raw := e.post(t, "/v1/messages", `{"model":"`+claudeModel+`","max_tokens":100,"messages":[{"role":"user","content":"bad"}]}`)
	if typ, code, _, _ := anthropicErrorOf(t, raw); r.StatusCode != 503 || typ != "overloaded_error" || code != "model_unavailable" || strings.Contains(raw, "secret") {
		t.Fatalf("%d %s", r.StatusCode, raw)
	}
}

// busy is the task limits' refusal of a call while too many are in
// flight, with its Retry-After.
type busy struct{}

func (busy) Error() string             { return tasklimits.ErrTooManyCalls.Error() }
func (busy) Unwrap() error             { return tasklimits.ErrTooManyCalls }
func (busy) RetryAfter() time.Duration { return 2 * time.Second }

// TestMessagesRefusalThroughSDK: a refusal of the task's limits reaches
// the Anthropic SDK through the error writer the handler is handed, with
// its status, type, request id and Retry-After (api's writer is tested in
// package api).
func TestMessagesRefusalThroughSDK(t *testing.T) {
	up := okMessages(t)
	e := newMsgEnv(t, up.upstream(), WireAnthropic, nil)
	e.gov.refuse = busy{}
	_, err := e.client.Messages.New(t.Context(), userText("go"))
	var apiErr *anthropic.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 429 || string(apiErr.Type()) != "rate_limit_error" || apiErr.RequestID != "req_test" ||
		apiErr.Response.Header.Get("Retry-After") != "2" || !strings.Contains(apiErr.RawJSON(), `"code":"too_many_calls"`) {
		t.Fatalf("%v", err)
	}
}
