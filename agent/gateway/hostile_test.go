package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"

	"faregate/protect/budget"
	"faregate/protect/codes"
	"faregate/protect/kit/testkit/clocktest"
)

// jsonUpstream answers every call with the JSON answer of the moment.
func jsonUpstream(t *testing.T, answer *string) *scripted {
	return newScripted(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, *answer)
	})
}

// words is n distinct-looking words (no loop), one cl100k token each with
// the space before them most of the time.
func words(n int) string {
	vocab := strings.Fields("the and for sun sea red old new hill tram fish wine port view walk park town city bay boat cafe tile lamp rain west east gold blue fig rice soup cake tea jam map bus road step door roof bell song")
	var b strings.Builder
	for i := range n {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(vocab[(i*7+i*i*3)%len(vocab)])
	}
	return b.String()
}

// TestJSONAnswerPastReservation: a JSON answer whose output passes its
// reservation by more than the tolerance is cut to it before it is
// relayed (chat: its content, the tool calls after the cut dropped,
// finish_reason length; Responses: status incomplete), charged all the
// provider produced; one that cannot be cut well formed is refused 502
// upstream_invalid; one within the tolerance passes byte for byte.
func TestJSONAnswerPastReservation(t *testing.T) {
	var answer string
	up := jsonUpstream(t, &answer)
	e := newEnv(t, up.upstream(), nil)
	e.gov.cap = 40
	long := words(2000)
	chat := func(msg string) string {
		return `{"id":"x","object":"chat.completion","model":"gpt-4o-mini","choices":[{"index":0,"message":` + msg + `,"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":0,"total_tokens":9}}`
	}
	text, _ := json.Marshal(long)
	chatBody := `{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}`

	t.Run("chat cut", func(t *testing.T) {
		answer = chat(`{"role":"assistant","content":` + string(text) + `,"tool_calls":[{"id":"c1","type":"function","function":{"name":"weather","arguments":"{}"}}]}`)
		c := e.client
		got, err := c.Chat.Completions.New(context.Background(), openai.ChatCompletionNewParams{Model: testModel,
			Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hi")}})
		if err != nil {
			t.Fatal(err)
		}
		ch := got.Choices[0]
		if ch.FinishReason != "length" || len(ch.Message.ToolCalls) != 0 || !strings.HasPrefix(long, ch.Message.Content) ||
			newOutCounterOf(testModel, ch.Message.Content) > 40 || newOutCounterOf(testModel, ch.Message.Content) < 30 {
			t.Fatalf("cut answer: finish %q, %d tool calls, content %d tokens %.80q", ch.FinishReason, len(ch.Message.ToolCalls),
				newOutCounterOf(testModel, ch.Message.Content), ch.Message.Content)
		}
		_, _, out, err := e.gov.last(t)
		if err != nil || !out.Truncated || out.Counted < 2000 || !out.Exact || out.Cut != "" {
			t.Fatalf("outcome %+v %v: want all 2,000 tokens counted (charged as overage), truncated", out, err)
		}
	})
	t.Run("reasoning past the reservation", func(t *testing.T) {
		answer = chat(`{"role":"assistant","reasoning_content":` + string(text) + `,"content":"The answer."}`)
		r, b := e.post(t, "/v1/chat/completions", chatBody)
		var got struct {
			Choices []struct {
				Message struct {
					Content   *string `json:"content"`
					Reasoning string  `json:"reasoning_content"`
				} `json:"message"`
				FinishReason string `json:"finish_reason"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(b), &got); err != nil || r.StatusCode != 200 {
			t.Fatalf("%d %v %.200s", r.StatusCode, err, b)
		}
		m := got.Choices[0]
		if m.FinishReason != "length" || m.Message.Content != nil || !strings.HasPrefix(long, m.Message.Reasoning) || len(m.Message.Reasoning) > 300 {
			t.Fatalf("cut in the reasoning: %+v", m)
		}
	})
	t.Run("within the tolerance", func(t *testing.T) {
		answer = chat(`{"role":"assistant","content":"` + words(45) + `"}`)
		r, b := e.post(t, "/v1/chat/completions", chatBody)
		if r.StatusCode != 200 || b != answer {
			t.Fatalf("an answer 5 tokens past 40 was not relayed as it came: %d %.200s", r.StatusCode, b)
		}
	})
	t.Run("several choices cannot be cut", func(t *testing.T) {
		answer = `{"id":"x","object":"chat.completion","model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":` + string(text) + `}},{"index":1,"message":{"role":"assistant","content":"b"}}]}`
		r, b := e.post(t, "/v1/chat/completions", chatBody)
		if code, typ, _ := errorOf(t, b); r.StatusCode != 502 || code != "upstream_invalid" || typ != "api_error" {
			t.Fatalf("%d %s", r.StatusCode, b)
		}
		_, _, out, err := e.gov.last(t)
		if !errors.Is(err, ErrUpstreamAnswer) || out.Counted < 2000 {
			t.Fatalf("outcome %+v err %v: want every choice counted", out, err)
		}
	})
	t.Run("responses cut", func(t *testing.T) {
		answer = `{"id":"resp_1","object":"response","status":"completed","model":"gpt-4o-mini","output":[` +
			`{"type":"message","id":"m1","status":"completed","role":"assistant","content":[{"type":"output_text","text":` + string(text) + `,"annotations":[]}]},` +
			`{"type":"function_call","id":"f1","call_id":"c1","name":"weather","arguments":"{}","status":"completed"}],"usage":{"input_tokens":5,"output_tokens":3,"total_tokens":8}}`
		got, err := e.client.Responses.New(context.Background(), responses.ResponseNewParams{Model: testModel,
			Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("hi")}})
		if err != nil {
			t.Fatal(err)
		}
		if got.Status != "incomplete" || got.IncompleteDetails.Reason != "max_output_tokens" || len(got.Output) != 1 ||
			!strings.HasPrefix(long, got.OutputText()) || newOutCounterOf(testModel, got.OutputText()) > 40 {
			t.Fatalf("cut response: status %q reason %q, %d items, %.80q", got.Status, got.IncompleteDetails.Reason, len(got.Output), got.OutputText())
		}
	})
}

// TestJSONLoopCut: with the loop cut on, a JSON answer whose content or
// tool-call arguments loop is relayed cut at the loop with finish_reason
// length (Responses: incomplete), and says output_loop; output that
// repeats by nature (a Markdown table, a JSON array of records) is
// relayed as it came.
func TestJSONLoopCut(t *testing.T) {
	var answer string
	up := jsonUpstream(t, &answer)
	e := newEnv(t, up.upstream(), func(o *Options) { o.LoopThreshold = 0.8 })
	e.gov.cap = 4000 // the loop, not the reservation, cuts here
	chat := func(msg string) string {
		return `{"id":"x","object":"chat.completion","model":"gpt-4o-mini","choices":[{"index":0,"message":` + msg + `,"finish_reason":"stop"}]}`
	}
	quote := func(s string) string { b, _ := json.Marshal(s); return string(b) }
	la := strings.Repeat("la ", 300)
	chatBody := `{"model":"gpt-4o-mini","messages":[{"role":"user","content":"sing"}]}`
	for _, c := range []struct {
		name, answer string
		looped       bool
	}{
		{"content", chat(`{"role":"assistant","content":` + quote(la) + `}`), true},
		{"tool-call arguments", chat(`{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"sing","arguments":` + quote(`{"lyrics":"`+la+`"}`) + `}}]}`), true},
		{"a Markdown table", chat(`{"role":"assistant","content":` + quote(markdownTable(60)) + `}`), false},
		{"a JSON array of records", chat(`{"role":"assistant","content":` + quote(jsonRecords(60)) + `}`), false},
	} {
		t.Run(c.name, func(t *testing.T) {
			answer = c.answer
			r, b := e.post(t, "/v1/chat/completions", chatBody)
			_, _, out, err := e.gov.last(t)
			if r.StatusCode != 200 || err != nil {
				t.Fatalf("%d %v %.200s", r.StatusCode, err, b)
			}
			if !c.looped {
				if b != answer || out.Truncated || out.Cut != "" {
					t.Fatalf("cut as a loop: %+v %.200s", out, b)
				}
				return
			}
			if !strings.Contains(b, `"finish_reason":"length"`) || len(b) > len(answer)/2 || out.Cut != codes.OutputLoop || !out.Truncated {
				t.Fatalf("not cut at the loop: %+v, %d of %d bytes: %.200s", out, len(b), len(answer), b)
			}
			if out.Counted < newOutCounterOf(testModel, la)/2 {
				t.Fatalf("charged %d tokens: the whole answer is charged", out.Counted)
			}
		})
	}
	t.Run("responses", func(t *testing.T) {
		answer = `{"id":"resp_1","object":"response","status":"completed","model":"gpt-4o-mini","output":[{"type":"message","id":"m1","status":"completed","role":"assistant","content":[{"type":"output_text","text":` + quote(la) + `,"annotations":[]}]}]}`
		got, err := e.client.Responses.New(context.Background(), responses.ResponseNewParams{Model: testModel,
			Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("sing")}})
		if err != nil || got.Status != "incomplete" || len(got.OutputText()) > len(la)/2 {
			t.Fatalf("%v: status %q, %d bytes of text", err, got.Status, len(got.OutputText()))
		}
		if _, _, out, _ := e.gov.last(t); out.Cut != codes.OutputLoop {
			t.Fatalf("outcome %+v", out)
		}
	})
}

// markdownTable is an itinerary table of n rows: it repeats its framing
// on every row, by nature.
func markdownTable(n int) string {
	cities := strings.Fields("Lisbon Porto Faro Braga Coimbra Evora Sintra Cascais Aveiro Viseu Tomar Obidos Nazare Lagos Tavira Guimaraes Leiria Setubal Beja Braganca")
	var b strings.Builder
	b.WriteString("| Day | City | Morning | Afternoon | Evening |\n|---|---|---|---|---|\n")
	for i := range n {
		c := cities[i%len(cities)]
		fmt.Fprintf(&b, "| %d | %s | Walk the old town of %s | Museum | Dinner by the river |\n", i+1, c, c)
	}
	return b.String()
}

// jsonRecords is a JSON array of n records of the same shape.
func jsonRecords(n int) string {
	cities := strings.Fields("Lisbon Porto Faro Braga Coimbra Evora Sintra Cascais Aveiro Viseu Tomar Obidos Nazare Lagos Tavira Guimaraes Leiria Setubal Beja Braganca")
	var b strings.Builder
	b.WriteString("[")
	for i := range n {
		if i > 0 {
			b.WriteString(",")
		}
		fmt.Fprintf(&b, `{"id":%d,"city":%q,"country":"Portugal","population":%d,"region":"%s region"}`, i, cities[i%len(cities)], 10000+i*37, cities[(i*3)%len(cities)])
	}
	return b.String() + "]"
}

// TestStreamLoopCut: a stream whose content, or tool-call arguments, or
// Responses text loops is cut at the loop, well formed for the official
// client (finish_reason length and the usage chunk; response.incomplete),
// long before its reservation, and says output_loop; a stream that
// repeats by nature, as long, is not cut.
func TestStreamLoopCut(t *testing.T) {
	la := strings.Split(strings.Repeat("la ", 400), " ")
	piecesOf := func(s string) []string {
		var out []string
		for i := 0; i < len(s); i += 9 {
			out = append(out, s[i:min(i+9, len(s))])
		}
		return out
	}
	chatStream := func(pieces []string, tool bool) func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		return func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
			w.Header().Set("Content-Type", "text/event-stream")
			for i, p := range pieces {
				delta := map[string]any{"content": p}
				if tool {
					fn := map[string]any{"arguments": p}
					if i == 0 {
						fn["name"] = "sing"
					}
					delta = map[string]any{"tool_calls": []any{map[string]any{"index": 0, "id": "c1", "type": "function", "function": fn}}}
				}
				b, _ := json.Marshal(map[string]any{"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": testModel,
					"choices": []any{map[string]any{"index": 0, "delta": delta}}})
				if _, err := fmt.Fprintf(w, "data: %s\n\n", b); err != nil {
					return
				}
				w.(http.Flusher).Flush()
			}
			_, _ = io.WriteString(w, `data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}`+"\n\ndata: [DONE]\n\n")
		}
	}
	for _, c := range []struct {
		name   string
		pieces []string
		tool   bool
		looped bool
	}{
		{"content", append([]string{"la"}, prefixed(la[1:])...), false, true},
		{"tool-call arguments", append([]string{`{"lyrics":"`}, prefixed(la)...), true, true},
		{"a Markdown table", piecesOf(markdownTable(60)), false, false},
		{"a JSON array of records in arguments", piecesOf(jsonRecords(60)), true, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			up := newScripted(t, chatStream(c.pieces, c.tool))
			e := newEnv(t, up.upstream(), func(o *Options) { o.LoopThreshold = 0.8 })
			e.gov.cap = 4000
			stream := e.client.Chat.Completions.NewStreaming(context.Background(), chatStreamParams(true))
			var acc openai.ChatCompletionAccumulator
			for stream.Next() {
				acc.AddChunk(stream.Current())
			}
			if err := stream.Err(); err != nil {
				t.Fatal(err)
			}
			_, _, out, _ := e.gov.last(t)
			finish := acc.Choices[0].FinishReason
			if !c.looped {
				if finish != "stop" || out.Cut != "" || out.Truncated {
					t.Fatalf("cut as a loop: finish %q, outcome %+v", finish, out)
				}
				return
			}
			if finish != "length" || out.Cut != codes.OutputLoop || out.Counted >= 100 || acc.Usage.CompletionTokens != out.Counted {
				t.Fatalf("finish %q, usage %d, outcome %+v: want cut at the loop under 100 tokens", finish, acc.Usage.CompletionTokens, out)
			}
		})
	}
	t.Run("responses", func(t *testing.T) {
		up := newScripted(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
			w.Header().Set("Content-Type", "text/event-stream")
			seq := responsesOpening(w)
			for _, p := range prefixed(la) {
				fmt.Fprintf(w, "data: {\"type\":\"response.output_text.delta\",\"sequence_number\":%d,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"delta\":%q}\n\n", seq, p)
				seq++
			}
			fmt.Fprintf(w, "data: {\"type\":\"response.completed\",\"sequence_number\":%d,\"response\":{\"id\":\"resp_1\",\"status\":\"completed\",\"output\":[]}}\n\n", seq)
		})
		e := newEnv(t, up.upstream(), func(o *Options) { o.LoopThreshold = 0.8 })
		stream := e.client.Responses.NewStreaming(context.Background(), responses.ResponseNewParams{Model: testModel,
			Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("sing")}})
		var last responses.ResponseStreamEventUnion
		for stream.Next() {
			last = stream.Current()
		}
		if err := stream.Err(); err != nil || last.Type != "response.incomplete" {
			t.Fatalf("last event %q, err %v", last.Type, err)
		}
		if _, _, out, _ := e.gov.last(t); out.Cut != codes.OutputLoop || out.Counted >= 100 {
			t.Fatalf("outcome %+v", out)
		}
	})
}

// prefixed puts a space before every word but the first.
func prefixed(ws []string) []string {
	out := make([]string, 0, len(ws))
	for i, w := range ws {
		if w == "" {
			continue
		}
		if i > 0 {
			w = " " + w
		}
		out = append(out, w)
	}
	return out
}

// TestResponsesDoneOnlyText: a Responses stream whose text comes only in
// the events that close it (no deltas) is counted from them, cut at its
// reservation, and charged what it sent; an honest stream's closing
// events (the same text as its deltas) are not counted twice.
func TestResponsesDoneOnlyText(t *testing.T) {
	long := words(3000)
	item := func(text string) string {
		b, _ := json.Marshal(map[string]any{"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
			"content": []any{map[string]any{"type": "output_text", "text": text, "annotations": []any{}}}})
		return string(b)
	}
	doneOnly := func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		w.Header().Set("Content-Type", "text/event-stream")
		seq := responsesOpening(w)
		fmt.Fprintf(w, "data: {\"type\":\"response.output_item.done\",\"sequence_number\":%d,\"output_index\":0,\"item\":%s}\n\n", seq, item(long))
		fmt.Fprintf(w, "data: {\"type\":\"response.completed\",\"sequence_number\":%d,\"response\":{\"id\":\"resp_1\",\"status\":\"completed\",\"output\":[],\"usage\":{\"input_tokens\":5,\"output_tokens\":1,\"total_tokens\":6}}}\n\n", seq+1)
	}
	up := newScripted(t, doneOnly)
	e := newEnv(t, up.upstream(), nil)
	e.gov.cap = 1032
	lines := rawSSE(t, e, "/v1/responses", `{"model":"gpt-4o-mini","input":"hi","stream":true}`)
	_, _, out, _ := e.gov.last(t)
	if !out.Truncated || out.Counted < 3000 || strings.Contains(strings.Join(lines, "\n"), long[:200]) ||
		!strings.Contains(lines[len(lines)-1], `"status":"incomplete"`) {
		t.Fatalf("outcome %+v; last %.200q", out, lines[len(lines)-1])
	}

	honest := newScripted(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		w.Header().Set("Content-Type", "text/event-stream")
		seq := responsesOpening(w)
		text := words(50)
		for _, p := range prefixed(strings.Fields(text)) {
			fmt.Fprintf(w, "data: {\"type\":\"response.output_text.delta\",\"sequence_number\":%d,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"delta\":%q}\n\n", seq, p)
			seq++
		}
		fmt.Fprintf(w, "data: {\"type\":\"response.output_text.done\",\"sequence_number\":%d,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"text\":%q}\n\n", seq, text)
		fmt.Fprintf(w, "data: {\"type\":\"response.content_part.done\",\"sequence_number\":%d,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"part\":{\"type\":\"output_text\",\"text\":%q}}\n\n", seq+1, text)
		fmt.Fprintf(w, "data: {\"type\":\"response.output_item.done\",\"sequence_number\":%d,\"output_index\":0,\"item\":%s}\n\n", seq+2, item(text))
		fmt.Fprintf(w, "data: {\"type\":\"response.completed\",\"sequence_number\":%d,\"response\":{\"id\":\"resp_1\",\"status\":\"completed\",\"output\":[]}}\n\n", seq+3)
	})
	e = newEnv(t, honest.upstream(), nil)
	rawSSE(t, e, "/v1/responses", `{"model":"gpt-4o-mini","input":"hi","stream":true}`)
	_, _, out, _ = e.gov.last(t)
	if want := newOutCounterOf(testModel, words(50)); out.Truncated || out.Counted != want {
		t.Fatalf("honest stream: outcome %+v, want %d tokens counted once", out, want)
	}
}

// TestUsageNeverLowered: a second usage chunk below the first does not
// lower it.
func TestUsageNeverLowered(t *testing.T) {
	up := newScripted(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		sse(w, chunkJSON("Seven hills."),
			`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2000,"total_tokens":2009}}`,
			`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[],"usage":{"prompt_tokens":0,"completion_tokens":0,"total_tokens":0}}`,
			"data: [DONE]")
	})
	e := newEnv(t, up.upstream(), nil)
	rawSSE(t, e, "/v1/chat/completions", `{"model":"gpt-4o-mini","messages":[],"stream":true}`)
	if _, _, out, _ := e.gov.last(t); !out.Usage.Reported || out.Usage.Completion != 2000 || out.Usage.Prompt != 9 {
		t.Fatalf("usage %+v, want the first report", out.Usage)
	}
}

// TestLegacyMaxTokens: with LegacyMaxTokens a chat call sends max_tokens
// beside the limit the agent chose, patched to the same value.
func TestLegacyMaxTokens(t *testing.T) {
	up := okUpstream(t)
	e := newEnv(t, up.upstream(), func(o *Options) { o.LegacyMaxTokens = true })
	e.gov.cap = 77
	for _, body := range []string{
		`{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":500}`,
		`{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}`,
	} {
		if r, b := e.post(t, "/v1/chat/completions", body); r.StatusCode != 200 {
			t.Fatalf("%d %s", r.StatusCode, b)
		}
		got := up.lastBody(t)
		if got["max_tokens"] != 77.0 || got["max_completion_tokens"] != 77.0 {
			t.Fatalf("%s: upstream got max_tokens %v, max_completion_tokens %v; want 77 and 77", body, got["max_tokens"], got["max_completion_tokens"])
		}
	}
}

// blockingTransport never writes a request: it holds it until its
// context ends, as a connection that never gets through would.
type blockingTransport struct{ held chan struct{} }

func (b blockingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	b.held <- struct{}{}
	<-r.Context().Done()
	return nil, r.Context().Err()
}

// TestChargedOnceSent: a call that ends before the provider's answer is
// charged by whether its request was written: a JSON call the agent hangs
// up on after the write, its reservation (client_closed); one cut by the
// call's deadline, its reservation (timeout, 503 before the first byte);
// a stream past its deadline ends well formed (timeout) with what passed;
// a call whose request was never written, nothing.
// hangUpOnceSent makes call (a prompt of at least 500 tokens, to an
// upstream that never answers), leaves it as soon as up has the request,
// and checks the call was charged its whole reservation as client_closed:
// the provider has the prompt and bills for it.
func hangUpOnceSent(t *testing.T, up *scripted, gov *fakeGov, call func(context.Context) error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// The watcher reports on a channel rather than through t: it must not
	// outlive the test, and the call must end even if the request never
	// reaches the provider.
	sent := make(chan bool, 1)
	go func() {
		ok := clocktest.Poll(10*time.Second, func() bool { up.mu.Lock(); defer up.mu.Unlock(); return len(up.bodies) > 0 })
		cancel()
		sent <- ok
	}()
	err := call(ctx)
	if !<-sent {
		t.Fatalf("the provider never had the call (the call ended with %v)", err)
	}
	if err == nil {
		t.Fatal("no error for a call the client left")
	}
	<-up.gone
	_, a, out, _ := gov.last(t)
	if !out.Sent || out.Ended != budget.OutcomeClientClosed || out.Counted != a.MaxOutput || out.Usage.Prompt < 500 {
		t.Fatalf("outcome %+v: want the reservation (%d), client_closed", out, a.MaxOutput)
	}
}

func TestChargedOnceSent(t *testing.T) {
	t.Run("hang-up after the write", func(t *testing.T) {
		up := newScripted(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) { <-r.Context().Done() })
		e := newEnv(t, up.upstream(), nil)
		hangUpOnceSent(t, up, e.gov, func(ctx context.Context) error {
			_, err := e.client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: testModel,
				Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage(strings.Repeat("word ", 500))}})
			return err
		})
	})
	t.Run("JSON past the call's deadline", func(t *testing.T) {
		up := newScripted(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) { <-r.Context().Done() })
		e := newEnv(t, up.upstream(), func(o *Options) { o.CallTimeout = 300 * time.Millisecond })
		r, b := e.post(t, "/v1/chat/completions", `{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}`)
		if code, _, _ := errorOf(t, b); r.StatusCode != 503 || code != "model_unavailable" {
			t.Fatalf("%d %s", r.StatusCode, b)
		}
		_, a, out, _ := e.gov.last(t)
		if !out.Sent || out.Ended != budget.OutcomeTimeout || out.Counted != a.MaxOutput {
			t.Fatalf("outcome %+v: want the reservation, timeout", out)
		}
	})
	t.Run("stream past the call's deadline", func(t *testing.T) {
		up := newScripted(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
			sse(w, chunkJSON("The first"), chunkJSON(" words"))
			<-r.Context().Done()
		})
		e := newEnv(t, up.upstream(), func(o *Options) { o.CallTimeout = 300 * time.Millisecond })
		stream := e.client.Chat.Completions.NewStreaming(context.Background(), chatStreamParams(true))
		var acc openai.ChatCompletionAccumulator
		for stream.Next() {
			acc.AddChunk(stream.Current())
		}
		if err := stream.Err(); err != nil || acc.Choices[0].FinishReason != "length" || acc.Usage.CompletionTokens != 3 ||
			acc.Choices[0].Message.Content != "The first words" {
			t.Fatalf("err %v finish %q usage %+v", err, acc.Choices[0].FinishReason, acc.Usage)
		}
		if _, _, out, _ := e.gov.last(t); out.Ended != budget.OutcomeTimeout || !out.Truncated || out.Counted != 3 {
			t.Fatalf("outcome %+v", out)
		}
	})
	t.Run("never written", func(t *testing.T) {
		held := make(chan struct{}, 1)
		up := Upstream{BaseURL: "http://provider.invalid/v1", Client: &http.Client{Transport: blockingTransport{held}}}
		e := newEnv(t, up, nil)
		ctx, cancel := context.WithCancel(context.Background())
		go func() {
			<-held
			cancel()
		}()
		_, err := e.client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: testModel,
			Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hi")}})
		if err == nil {
			t.Fatal("no error")
		}
		if _, _, out, _ := e.gov.last(t); out.Sent || out.Ended != "" || out.Counted != 0 {
			t.Fatalf("outcome %+v: a request never written is charged nothing", out)
		}
	})
}

// TestLongStreamOutlivesWriteTimeout: a stream longer than the server's
// write timeout arrives whole: the handler lifts the timeout to the
// call's deadline.
func TestLongStreamOutlivesWriteTimeout(t *testing.T) {
	up := newScripted(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		w.Header().Set("Content-Type", "text/event-stream")
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for i := range 20 { // a second in all, five times the write timeout
			<-tick.C
			_, _ = io.WriteString(w, chunkJSON(fmt.Sprintf(" word%d", i))+"\n\n")
			w.(http.Flusher).Flush()
		}
		_, _ = io.WriteString(w, `data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}`+"\n\ndata: [DONE]\n\n")
	})
	var gov *fakeGov
	h := func() http.Handler {
		e := &env{gov: &fakeGov{up: ptr(up.upstream()), cap: 1000}}
		gov = e.gov
		task := Task{ID: "t", Principal: "p", Deadline: time.Now().Add(time.Hour), Models: []string{testModel}}
		return testMux(New(Options{Governor: e.gov, Records: testRecords, Task: func(*http.Request) (Task, bool) { return task, true }, Errors: testErrorWriter{}}))
	}()
	srv := httptest.NewUnstartedServer(h)
	srv.Config.WriteTimeout = 200 * time.Millisecond
	srv.Start()
	t.Cleanup(srv.Close)
	c := openai.NewClient(option.WithBaseURL(srv.URL+"/v1/"), option.WithAPIKey("k"), option.WithMaxRetries(0))
	stream := c.Chat.Completions.NewStreaming(context.Background(), chatStreamParams(true))
	var acc openai.ChatCompletionAccumulator
	for stream.Next() {
		acc.AddChunk(stream.Current())
	}
	if err := stream.Err(); err != nil || len(acc.Choices) != 1 || acc.Choices[0].FinishReason != "stop" || !strings.HasSuffix(acc.Choices[0].Message.Content, "word19") {
		t.Fatalf("err %v, choices %+v", err, acc.Choices)
	}
	if _, _, out, err := gov.last(t); err != nil || out.Truncated || out.Ended != "" {
		t.Fatalf("outcome %+v %v", out, err)
	}
}
