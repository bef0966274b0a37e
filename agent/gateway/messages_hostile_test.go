package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"

	"faregate/agent/govern"
	"faregate/protect/budget"
	"faregate/protect/codes"
)

// accumulateRaw decodes a raw Messages SSE answer with the SDK's event
// type and feeds its accumulator, as the SDK's own stream reader does: an
// error event ends it with an error.
func accumulateRaw(t *testing.T, raw string) (*anthropic.Message, error) {
	t.Helper()
	names, data := sseEvents(t, raw)
	var msg anthropic.Message
	for i, name := range names {
		if name == "error" {
			return &msg, errors.New("error event")
		}
		b, _ := json.Marshal(data[i])
		var ev anthropic.MessageStreamEventUnion
		if err := json.Unmarshal(b, &ev); err != nil {
			return &msg, err
		}
		if err := msg.Accumulate(ev); err != nil {
			return &msg, err
		}
	}
	return &msg, nil
}

func start(usage map[string]any) string {
	m := map[string]any{"id": "msg_h", "type": "message", "role": "assistant", "model": claudeModel, "content": []any{},
		"stop_reason": nil, "stop_sequence": nil}
	if usage != nil {
		m["usage"] = usage
	}
	return event(map[string]any{"type": "message_start", "message": m})
}

func blockStart(i int, block map[string]any) string {
	return event(map[string]any{"type": "content_block_start", "index": i, "content_block": block})
}

func blockDelta(i int, delta map[string]any) string {
	return event(map[string]any{"type": "content_block_delta", "index": i, "delta": delta})
}

func textDelta(i int, s string) string {
	return blockDelta(i, map[string]any{"type": "text_delta", "text": s})
}

func msgDeltaEv(stop string, usage map[string]any) string {
	ev := map[string]any{"type": "message_delta", "delta": map[string]any{"stop_reason": stop, "stop_sequence": nil}}
	if usage != nil {
		ev["usage"] = usage
	}
	return event(ev)
}

var stopEv = event(map[string]any{"type": "message_stop"})

// forever writes the events of head, then repeats piece until the
// client hangs up.
func forever(head []string, piece string) func(http.ResponseWriter, *http.Request, map[string]any) {
	return func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		sse(w, head...)
		for r.Context().Err() == nil {
			if _, err := io.WriteString(w, piece+"\n\n"); err != nil {
				return
			}
			w.(http.Flusher).Flush()
		}
	}
}

// TestMessagesHostileUpstream: each way an Anthropic upstream can
// misreport or misbehave on a stream is charged by the rules (usage
// read as cumulative, never lowered, bounded; what passed where the
// report is missing), cut where it must be, and ends well formed for the
// SDK: message_stop after a cut, event: error after a break.
func TestMessagesHostileUpstream(t *testing.T) {
	u0 := map[string]any{"input_tokens": 12, "cache_creation_input_tokens": 100, "cache_read_input_tokens": 2000, "output_tokens": 1}
	text := []string{blockStart(0, map[string]any{"type": "text", "text": ""}), textDelta(0, "Hello there, "), textDelta(0, "dear friend."),
		event(map[string]any{"type": "content_block_stop", "index": 0})}
	with := func(parts ...[]string) []string {
		var out []string
		for _, p := range parts {
			out = append(out, p...)
		}
		return out
	}
	huge := strings.Repeat("s", 16<<10)
	cases := []struct {
		name  string
		serve func(http.ResponseWriter, *http.Request, map[string]any)
		cap   int64
		// want: the stream's last events, the outcome's usage (prompt -1:
		// the estimate; completion -1: the count of what passed), whether
		// it ends in an error.
		last       string
		prompt     int64
		completion int64
		reported   bool
		truncated  bool
		err        bool
	}{
		{"usage only in message_start", func(w http.ResponseWriter, _ *http.Request, _ map[string]any) {
			sse(w, with([]string{start(u0)}, text, []string{msgDeltaEv("end_turn", nil), stopEv})...)
		}, 500, "message_delta,message_stop", 2112, -1, false, false, false},
		{"message_delta usage goes down", func(w http.ResponseWriter, _ *http.Request, _ map[string]any) {
			sse(w, with([]string{start(u0)}, text, []string{msgDeltaEv("", map[string]any{"output_tokens": 40}),
				msgDeltaEv("end_turn", map[string]any{"output_tokens": 10, "input_tokens": 3, "cache_read_input_tokens": 0}), stopEv})...)
		}, 500, "message_delta,message_stop", 2112, 40, true, false, false},
		{"message_delta usage repeats", func(w http.ResponseWriter, _ *http.Request, _ map[string]any) {
			sse(w, with([]string{start(u0)}, text, []string{msgDeltaEv("", map[string]any{"output_tokens": 40}),
				msgDeltaEv("end_turn", map[string]any{"output_tokens": 40}), stopEv})...)
		}, 500, "message_delta,message_stop", 2112, 40, true, false, false},
		{"no usage anywhere", func(w http.ResponseWriter, _ *http.Request, _ map[string]any) {
			sse(w, with([]string{start(nil)}, text, []string{msgDeltaEv("end_turn", nil), stopEv})...)
		}, 500, "message_delta,message_stop", -1, -1, false, false, false},
		{"usage that overflows", func(w http.ResponseWriter, _ *http.Request, _ map[string]any) {
			sse(w, with([]string{start(map[string]any{"input_tokens": -7, "output_tokens": 1})}, text,
				[]string{msgDeltaEv("end_turn", map[string]any{"output_tokens": 1e300}), stopEv})...)
		}, 500, "message_delta,message_stop", 0, 1 << 62, true, false, false},
		{"no message_stop", func(w http.ResponseWriter, _ *http.Request, _ map[string]any) {
			sse(w, with([]string{start(u0)}, text[:2])...)
		}, 500, "content_block_delta,error", 2112, -1, false, false, true},
		{"thinking only, forever", forever([]string{start(u0), blockStart(0, map[string]any{"type": "thinking", "thinking": "", "signature": ""})},
			blockDelta(0, map[string]any{"type": "thinking_delta", "thinking": "I wonder whether "})),
			60, "content_block_stop,message_delta,message_stop", 2112, -1, false, true, false},
		{"input_json_delta forever", forever([]string{start(u0), blockStart(0, map[string]any{"type": "tool_use", "id": "toolu_1", "name": "f", "input": map[string]any{}})},
			blockDelta(0, map[string]any{"type": "input_json_delta", "partial_json": `{"a":[1,2,3],`})),
			60, "content_block_stop,message_delta,message_stop", 2112, -1, false, true, false},
		{"an error event mid-stream", func(w http.ResponseWriter, _ *http.Request, _ map[string]any) {
			sse(w, with([]string{start(u0)}, text[:2], []string{`event: error
data: {"type":"error","error":{"type":"overloaded_error","message":"provider secret: node 7 down"}}`})...)
		}, 500, "content_block_delta,error", 2112, -1, false, false, true},
		{"bytes that are not output", forever([]string{start(u0), blockStart(0, map[string]any{"type": "thinking", "thinking": "", "signature": ""})},
			blockDelta(0, map[string]any{"type": "signature_delta", "signature": huge})),
			10, "content_block_stop,message_delta,message_stop", 2112, 10, false, true, false},
		{"blocks opened forever", forever([]string{start(u0)}, blockStart(0, map[string]any{"type": "text", "text": ""})),
			500, "content_block_start,error", 2112, -1, false, false, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			up := newAnthropicUpstream(t, c.serve)
			e := newMsgEnv(t, up.upstream(), WireAnthropic, nil)
			e.gov.cap = c.cap
			resp, raw := e.post(t, "/v1/messages", `{"model":"`+claudeModel+`","max_tokens":4000,"stream":true,"messages":[{"role":"user","content":"go"}]}`)
			if resp.StatusCode != 200 {
				t.Fatalf("%d %s", resp.StatusCode, raw)
			}
			names, data := sseEvents(t, raw)
			if got := strings.Join(names[max(len(names)-strings.Count(c.last, ",")-1, 0):], ","); got != c.last {
				t.Fatalf("the stream ends %s, want %s", got, c.last)
			}
			if c.err {
				errEv := data[len(data)-1]["error"].(map[string]any)
				if errEv["code"] != "model_unavailable" || strings.Contains(raw, "secret") {
					t.Fatalf("error event %v", errEv)
				}
			}
			if strings.HasSuffix(c.last, "message_stop") && strings.Contains(c.last, "message_delta") && c.truncated {
				if data[len(data)-2]["delta"].(map[string]any)["stop_reason"] != "max_tokens" {
					t.Fatalf("cut without max_tokens: %v", data[len(data)-2])
				}
			}
			if _, err := accumulateRaw(t, raw); (err != nil) != c.err {
				t.Fatalf("the SDK's accumulator: %v", err)
			}
			spec, _, out, err := e.gov.last(t)
			want := govern.Usage{Prompt: c.prompt, Completion: c.completion, Reported: c.reported}
			if c.prompt == -1 {
				want.Prompt = spec.PromptTokens
			}
			if c.prompt == 2112 {
				want.CacheCreation, want.CacheRead = 100, 2000
			}
			if c.completion == -1 {
				want.Completion = out.Counted
			}
			got := out.Usage
			got.Raw = ""
			if got != want || out.Truncated != c.truncated || (err != nil) != c.err || out.Counted > c.cap {
				t.Fatalf("outcome %+v (err %v), want usage %+v truncated %v", out, err, want, c.truncated)
			}
		})
	}
}

// TestMessagesHostileBeforeAnswer: an upstream whose stream breaks before
// anything reached the client (an error event first, an event over the
// bound, a broken JSON answer) is the provider's failure: 503 in
// Anthropic's shape, nothing of its text, and the governor may retry.
func TestMessagesHostileBeforeAnswer(t *testing.T) {
	for _, c := range []struct {
		name, body string
		serve      func(http.ResponseWriter, *http.Request, map[string]any)
	}{
		{"error event first", `"stream":true`, func(w http.ResponseWriter, _ *http.Request, _ map[string]any) {
			sse(w, `event: error
data: {"type":"error","error":{"type":"overloaded_error","message":"provider secret"}}`)
		}},
		{"an event over the bound", `"stream":true`, func(w http.ResponseWriter, _ *http.Request, _ map[string]any) {
			sse(w, "event: message_start\ndata: "+strings.Repeat("x", 8<<10))
		}},
		{"a JSON answer that is not a message", `"stream":false`, func(w http.ResponseWriter, _ *http.Request, _ map[string]any) {
			_, _ = io.WriteString(w, `{"type":"error","error":{"type":"api_error","message":"provider secret"}}`)
		}},
		{"an upstream 529", `"stream":false`, func(w http.ResponseWriter, _ *http.Request, _ map[string]any) {
			w.WriteHeader(529)
			_, _ = io.WriteString(w, `{"type":"error","error":{"type":"overloaded_error","message":"provider secret"}}`)
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			up := newAnthropicUpstream(t, c.serve)
			e := newMsgEnv(t, up.upstream(), WireAnthropic, func(o *Options, _ *MessagesOptions) { o.MaxEvent = 2048 })
			resp, raw := e.post(t, "/v1/messages", `{"model":"`+claudeModel+`","max_tokens":100,`+c.body+`,"messages":[{"role":"user","content":"go"}]}`)
			typ, code, _, _ := anthropicErrorOf(t, raw)
			if resp.StatusCode != 503 || typ != "overloaded_error" || code != "model_unavailable" || strings.Contains(raw, "secret") {
				t.Fatalf("%d %s", resp.StatusCode, raw)
			}
			if _, _, out, err := e.gov.last(t); !errors.Is(err, ErrUpstream) || out.Started {
				t.Fatalf("outcome %+v, %v: want a provider failure before the answer", out, err)
			}
		})
	}
}

// failAfter is a ResponseWriter whose client hangs up after n writes.
type failAfter struct {
	*httptest.ResponseRecorder
	n int
}

func (f *failAfter) Write(b []byte) (int, error) {
	if f.n <= 0 {
		return 0, errors.New("client gone")
	}
	f.n--
	return f.ResponseRecorder.Write(b)
}

// TestMessagesHangUpDrains: a client that hangs up mid-stream does not
// end the read of the provider's stream: it is drained to its final
// usage (the LiteLLM under-billing: a hang-up charged only what had
// passed), within the same bounds; a provider that goes on past the
// reservation is still cut there.
func TestMessagesHangUpDrains(t *testing.T) {
	h := &handler{o: Options{Errors: testAnthropicErrors{}, MaxEvent: DefaultMaxEvent, MaxAnswer: DefaultMaxAnswer}}
	m, err := parseMessages([]byte(`{"model":"`+claudeModel+`","max_tokens":500,"stream":true,"messages":[{"role":"user","content":"go"}]}`), anyModel, false)
	if err != nil {
		t.Fatal(err)
	}
	var evs []string
	evs = append(evs, msgStream()[:9]...) // to the first text delta
	for range 50 {
		evs = append(evs, textDelta(1, "and more "))
	}
	evs = append(evs, msgDeltaEv("end_turn", map[string]any{"output_tokens": 260}), stopEv)
	body := strings.Join(evs, "\n\n") + "\n\n"

	w := &failAfter{ResponseRecorder: httptest.NewRecorder(), n: 3}
	var end heldEnd
	out, err := h.relayMessages(context.Background(), w, m, govern.Attempt{Model: govern.Model{Name: claudeModel}, MaxOutput: 500}, strings.NewReader(body), &end)
	if err != nil || !out.Truncated || !out.Usage.Reported || out.Usage.Completion != 260 || out.Usage.Prompt != 2112 {
		t.Fatalf("a hang-up drained: %+v, %v; want the provider's final 260", out, err)
	}
	// The same stream past a reservation of 20: the drain stops there.
	w = &failAfter{ResponseRecorder: httptest.NewRecorder(), n: 3}
	out, _ = h.relayMessages(context.Background(), w, m, govern.Attempt{Model: govern.Model{Name: claudeModel}, MaxOutput: 20}, strings.NewReader(body), &end)
	if out.Usage.Reported || out.Counted > 20 || !out.Truncated {
		t.Fatalf("a drain past the reservation: %+v", out)
	}
}

// TestMessagesJSONBoundedByReservation: a JSON answer is relayed only
// within its reservation. One whose content outgrew it (an upstream that
// ignores max_tokens and reports 1 output token) is refused with the
// relay's code and charged what was counted, never believed at 1; one
// past the byte bound a stream of the reservation has is refused and
// charged the whole reservation; nothing of either reaches the agent.
func TestMessagesJSONBoundedByReservation(t *testing.T) {
	answer := func(text string) func(http.ResponseWriter, *http.Request, map[string]any) {
		return func(w http.ResponseWriter, _ *http.Request, _ map[string]any) {
			b, _ := json.Marshal(map[string]any{"id": "msg_b", "type": "message", "role": "assistant", "model": claudeModel,
				"content": []any{map[string]any{"type": "text", "text": text}}, "stop_reason": "end_turn",
				"usage": map[string]any{"input_tokens": 10, "output_tokens": 1}})
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write(b)
		}
	}
	// The same answer from an OpenAI-compatible upstream, translated.
	chatAnswer := func(text string) func(http.ResponseWriter, *http.Request, map[string]any) {
		return func(w http.ResponseWriter, _ *http.Request, _ map[string]any) {
			b, _ := json.Marshal(map[string]any{"id": "chatcmpl-b", "object": "chat.completion", "model": claudeModel,
				"choices": []any{map[string]any{"index": 0, "message": map[string]any{"role": "assistant", "content": text}, "finish_reason": "stop"}},
				"usage":   map[string]any{"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}})
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write(b)
		}
	}
	for _, c := range []struct {
		name    string
		wire    string
		text    string
		counted func(int64) bool
	}{
		{"content past the reservation", WireAnthropic, strings.Repeat("lorem ipsum dolor sit amet ", 400), func(n int64) bool { return n > 1000 }},
		{"bytes past the bound", WireAnthropic, strings.Repeat("x", 2<<20), func(n int64) bool { return n == 100 }},
		{"translated: content past the reservation", WireOpenAI, strings.Repeat("lorem ipsum dolor sit amet ", 400), func(n int64) bool { return n > 1000 }},
		{"translated: bytes past the bound", WireOpenAI, strings.Repeat("x", 2<<20), func(n int64) bool { return n == 100 }},
	} {
		t.Run(c.name, func(t *testing.T) {
			serve := answer(c.text)
			if c.wire == WireOpenAI {
				serve = chatAnswer(c.text)
			}
			up := newAnthropicUpstream(t, serve)
			e := newMsgEnv(t, up.upstream(), c.wire, nil)
			e.gov.cap = 100
			resp, raw := e.post(t, "/v1/messages", `{"model":"`+claudeModel+`","max_tokens":4000,"messages":[{"role":"user","content":"go"}]}`)
			if resp.StatusCode != http.StatusBadGateway || strings.Contains(raw, "lorem") || len(raw) > 4096 {
				t.Fatalf("%d %.200s", resp.StatusCode, raw)
			}
			_, a, out, err := e.gov.last(t)
			if !errors.Is(err, ErrUpstreamAnswer) || !out.Sent || out.Started || !c.counted(out.Counted) || a.MaxOutput != 100 {
				t.Fatalf("outcome %+v, err %v", out, err)
			}
		})
	}
	// Within the reservation, the answer passes byte for byte.
	up := newAnthropicUpstream(t, answer("Short and sweet."))
	e := newMsgEnv(t, up.upstream(), WireAnthropic, nil)
	e.gov.cap = 100
	if resp, raw := e.post(t, "/v1/messages", `{"model":"`+claudeModel+`","max_tokens":4000,"messages":[{"role":"user","content":"go"}]}`); resp.StatusCode != 200 ||
		!strings.Contains(raw, "Short and sweet.") {
		t.Fatalf("%d %s", resp.StatusCode, raw)
	}
}

// TestMessagesChargedOnceSent: a Messages call that ends before an
// Anthropic provider answered is charged as on the other routes, by
// whether its request was written: the agent hanging up after the write,
// its reservation (client_closed); the call's deadline, its reservation
// (timeout) and 503 in Anthropic's shape.
func TestMessagesChargedOnceSent(t *testing.T) {
	body := `{"model":"` + claudeModel + `","max_tokens":300,"messages":[{"role":"user","content":"` + strings.Repeat("word ", 500) + `"}]}`
	t.Run("hang-up after the write", func(t *testing.T) {
		up := newAnthropicUpstream(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) { <-r.Context().Done() })
		e := newMsgEnv(t, up.upstream(), WireAnthropic, nil)
		hangUpOnceSent(t, up.scripted, e.gov, func(ctx context.Context) error {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, e.srv.URL+"/v1/messages", strings.NewReader(body))
			req.Header.Set("Content-Type", "application/json")
			resp, err := http.DefaultClient.Do(req)
			if err == nil {
				resp.Body.Close()
			}
			return err
		})
	})
	t.Run("past the call's deadline", func(t *testing.T) {
		up := newAnthropicUpstream(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) { <-r.Context().Done() })
		e := newMsgEnv(t, up.upstream(), WireAnthropic, func(o *Options, _ *MessagesOptions) { o.CallTimeout = 300 * time.Millisecond })
		resp, raw := e.post(t, "/v1/messages", body)
		if resp.StatusCode != 503 || !strings.Contains(raw, `"type":"error"`) || !strings.Contains(raw, "model_unavailable") {
			t.Fatalf("%d %s", resp.StatusCode, raw)
		}
		_, a, out, _ := e.gov.last(t)
		if !out.Sent || out.Ended != budget.OutcomeTimeout || out.Counted != a.MaxOutput {
			t.Fatalf("outcome %+v: want the reservation, timeout", out)
		}
	})
}

// TestMessagesLoopCut: a Messages stream whose text repeats is cut at the
// loop as the chat route's is (Options.LoopThreshold), forwarded and
// translated alike: the open block's content_block_stop, message_delta
// with stop_reason "max_tokens", message_stop; the outcome says
// output_loop. A Markdown table, repetitive but not a loop, passes whole.
func TestMessagesLoopCut(t *testing.T) {
	la := prefixed(strings.Split(strings.Repeat("la ", 400), " "))
	table := strings.SplitAfter(markdownTable(60), "\n")
	anthropicStream := func(pieces []string) func(http.ResponseWriter, *http.Request, map[string]any) {
		return func(w http.ResponseWriter, _ *http.Request, _ map[string]any) {
			evs := []string{start(map[string]any{"input_tokens": 5, "output_tokens": 1}), blockStart(0, map[string]any{"type": "text", "text": ""})}
			for _, p := range pieces {
				evs = append(evs, textDelta(0, p))
			}
			sse(w, append(evs, event(map[string]any{"type": "content_block_stop", "index": 0}),
				msgDeltaEv("end_turn", map[string]any{"output_tokens": 3000}), stopEv)...)
		}
	}
	chatStream := func(pieces []string) func(http.ResponseWriter, *http.Request, map[string]any) {
		return func(w http.ResponseWriter, _ *http.Request, _ map[string]any) {
			w.Header().Set("Content-Type", "text/event-stream")
			for _, p := range pieces {
				b, _ := json.Marshal(map[string]any{"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": testModel,
					"choices": []any{map[string]any{"index": 0, "delta": map[string]any{"content": p}}}})
				if _, err := io.WriteString(w, "data: "+string(b)+"\n\n"); err != nil {
					return
				}
			}
			_, _ = io.WriteString(w, `data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}`+"\n\ndata: [DONE]\n\n")
		}
	}
	for _, wire := range []string{WireAnthropic, WireOpenAI} {
		for _, c := range []struct {
			name   string
			pieces []string
			looped bool
		}{{"a loop", la, true}, {"a Markdown table", table, false}} {
			t.Run(wire+"/"+c.name, func(t *testing.T) {
				serve := anthropicStream(c.pieces)
				if wire == WireOpenAI {
					serve = chatStream(c.pieces)
				}
				up := newAnthropicUpstream(t, serve)
				e := newMsgEnv(t, up.upstream(), wire, func(o *Options, _ *MessagesOptions) { o.LoopThreshold = 0.8 })
				resp, raw := e.post(t, "/v1/messages", `{"model":"`+claudeModel+`","max_tokens":4000,"stream":true,"messages":[{"role":"user","content":"sing"}]}`)
				if resp.StatusCode != 200 {
					t.Fatalf("%d %s", resp.StatusCode, raw)
				}
				msg, err := accumulateRaw(t, raw)
				if err != nil {
					t.Fatal(err)
				}
				_, _, out, _ := e.gov.last(t)
				if !c.looped {
					if msg.StopReason == "max_tokens" || out.Cut != "" || out.Truncated {
						t.Fatalf("cut as a loop: %s, outcome %+v", msg.StopReason, out)
					}
					return
				}
				if msg.StopReason != "max_tokens" || out.Cut != codes.OutputLoop || out.Counted >= 100 || !strings.HasSuffix(strings.TrimSpace(raw), `data: {"type":"message_stop"}`) {
					t.Fatalf("stop %q, outcome %+v: want a cut at the loop under 100 tokens, ended well formed", msg.StopReason, out)
				}
			})
		}
	}
}
