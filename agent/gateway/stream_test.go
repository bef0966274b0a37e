package gateway

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/responses"

	"faregate/protect/budget"
	"faregate/protect/kit/testkit/clocktest"
)

// endless streams content chunks until the request ends, ignoring every
// limit it was sent: the hostile provider a cut exists for.
func endless(piece string) func(http.ResponseWriter, *http.Request, map[string]any) {
	return func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i := 0; r.Context().Err() == nil; i++ {
			if _, err := io.WriteString(w, chunkJSON(piece)+"\n\n"); err != nil {
				return
			}
			w.(http.Flusher).Flush()
		}
	}
}

func chatStreamParams(includeUsage bool) openai.ChatCompletionNewParams {
	p := openai.ChatCompletionNewParams{Model: testModel, Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("go on")}}
	if includeUsage {
		p.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
	}
	return p
}

// rawSSE posts body and returns the data lines of the answer.
func rawSSE(t *testing.T, e *env, path, body string) []string {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, e.srv.URL+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var lines []string
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if d, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			lines = append(lines, d)
		}
	}
	return lines
}

func TestChatStreamCutAtLimit(t *testing.T) {
	up := newScripted(t, endless("hello "))
	e := newEnv(t, up.upstream(), nil)
	e.gov.cap = 20
	stream := e.client.Chat.Completions.NewStreaming(context.Background(), chatStreamParams(true))
	var acc openai.ChatCompletionAccumulator
	var last openai.ChatCompletionChunk
	for stream.Next() {
		last = stream.Current()
		acc.AddChunk(last)
	}
	if err := stream.Err(); err != nil {
		t.Fatalf("the official reader rejected the cut stream: %v", err)
	}
	if acc.Choices[0].FinishReason != "length" {
		t.Fatalf("finish %q", acc.Choices[0].FinishReason)
	}
	if len(last.Choices) != 0 || last.Usage.CompletionTokens == 0 {
		t.Fatalf("the last chunk is not the usage chunk: %+v", last)
	}
	_, a, out, err := e.gov.last(t)
	if err != nil || !out.Truncated || out.Usage.Reported {
		t.Fatalf("outcome %+v err %v", out, err)
	}
	if out.Counted > a.MaxOutput || out.Counted < a.MaxOutput-2 || last.Usage.CompletionTokens != out.Counted {
		t.Fatalf("counted %d of %d, client told %d", out.Counted, a.MaxOutput, last.Usage.CompletionTokens)
	}
	// What passed is what was counted.
	if got := newOutCounterOf(testModel, acc.Choices[0].Message.Content); got != out.Counted {
		t.Fatalf("text passed counts %d, outcome says %d", got, out.Counted)
	}
	<-up.gone // the provider was hung up on

	// Raw: a finish chunk, the usage chunk, then [DONE]; without
	// include_usage no usage chunk.
	lines := rawSSE(t, e, "/v1/chat/completions", `{"model":"gpt-4o-mini","messages":[],"stream":true}`)
	n := len(lines)
	if n < 3 || lines[n-1] != "[DONE]" || !strings.Contains(lines[n-2], `"finish_reason":"length"`) || strings.Contains(lines[n-2], `"usage"`) {
		t.Fatalf("ending %q", lines[max(0, n-3):])
	}
}

func newOutCounterOf(model, s string) int64 {
	c := newOutCounter(model)
	c.Add(s)
	return c.Tokens()
}

// responsesEvents is a Responses stream's opening: created, one message
// item and its text part.
func responsesOpening(w io.Writer) int {
	seq := 0
	ev := func(typ, rest string) {
		fmt.Fprintf(w, "event: %s\ndata: {\"type\":%q,\"sequence_number\":%d,%s}\n\n", typ, typ, seq, rest)
		seq++
	}
	ev("response.created", `"response":{"id":"resp_1","object":"response","created_at":1,"model":"gpt-4o-mini","status":"in_progress","output":[]}`)
	ev("response.output_item.added", `"output_index":0,"item":{"type":"message","id":"msg_1","role":"assistant","status":"in_progress","content":[]}`)
	ev("response.content_part.added", `"item_id":"msg_1","output_index":0,"content_index":0,"part":{"type":"output_text","text":"","annotations":[]}`)
	return seq
}

func TestResponsesStreamCutAtLimit(t *testing.T) {
	up := newScripted(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		w.Header().Set("Content-Type", "text/event-stream")
		seq := responsesOpening(w)
		for ; r.Context().Err() == nil; seq++ {
			_, err := fmt.Fprintf(w, "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"sequence_number\":%d,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"delta\":\"word \"}\n\n", seq)
			if err != nil {
				return
			}
			w.(http.Flusher).Flush()
		}
	})
	e := newEnv(t, up.upstream(), nil)
	e.gov.cap = 30
	stream := e.client.Responses.NewStreaming(context.Background(), responses.ResponseNewParams{Model: testModel,
		Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("go on")}})
	var text strings.Builder
	var final responses.Response
	var types []string
	var seq int64 = -1
	for stream.Next() {
		ev := stream.Current()
		types = append(types, ev.Type)
		if ev.SequenceNumber != seq+1 {
			t.Fatalf("sequence %d after %d", ev.SequenceNumber, seq)
		}
		seq = ev.SequenceNumber
		switch ev.Type {
		case "response.output_text.delta":
			text.WriteString(ev.Delta)
		case "response.incomplete":
			final = ev.AsResponseIncomplete().Response
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if types[len(types)-1] != "response.incomplete" || final.Status != "incomplete" || final.IncompleteDetails.Reason != "max_output_tokens" {
		t.Fatalf("ending %v, final %+v", types[len(types)-4:], final)
	}
	if final.OutputText() != text.String() || final.ID != "resp_1" {
		t.Fatalf("final output %q id %q, streamed %q", final.OutputText(), final.ID, text.String())
	}
	_, a, out, _ := e.gov.last(t)
	if !out.Truncated || out.Counted > a.MaxOutput || final.Usage.OutputTokens != out.Counted || newOutCounterOf(testModel, text.String()) != out.Counted {
		t.Fatalf("outcome %+v, final usage %+v", out, final.Usage)
	}
	want := []string{"response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete"}
	if got := types[len(types)-4:]; strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("closing events %v", got)
	}
}

// Upstream usage arrives with "choices": [], null or absent; it is read
// each way, and reaches the client only when it asked for it.
func TestUsageChunkShapes(t *testing.T) {
	for _, shape := range []string{`"choices":[],`, `"choices":null,`, ``} {
		up := newScripted(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
			sse(w, chunkJSON("one"), chunkJSON(" two"),
				`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini",`+shape+`"usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9,"completion_tokens_details":{"reasoning_tokens":0}}}`,
				"data: [DONE]")
		})
		e := newEnv(t, up.upstream(), nil)
		for _, include := range []bool{false, true} {
			stream := e.client.Chat.Completions.NewStreaming(context.Background(), chatStreamParams(include))
			sawUsage := false
			for stream.Next() {
				if stream.Current().Usage.TotalTokens > 0 {
					sawUsage = true
				}
			}
			if err := stream.Err(); err != nil {
				t.Fatal(err)
			}
			if sawUsage != include {
				t.Fatalf("shape %q include %v: client saw usage %v", shape, include, sawUsage)
			}
			_, _, out, _ := e.gov.last(t)
			if !out.Usage.Reported || out.Usage.Prompt != 7 || out.Usage.Completion != 2 || !strings.Contains(out.Usage.Raw, `"prompt_tokens":7`) {
				t.Fatalf("shape %q: usage %+v", shape, out.Usage)
			}
		}
	}
}

// A provider that reports no usage: the call is settled on the count of
// what passed, marked estimated, and a client that asked for usage gets
// that estimate.
func TestStreamWithoutUsage(t *testing.T) {
	up := newScripted(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		sse(w, chunkJSON("Lisbon has"), chunkJSON(" seven hills."), "data: [DONE]")
	})
	e := newEnv(t, up.upstream(), nil)
	stream := e.client.Chat.Completions.NewStreaming(context.Background(), chatStreamParams(true))
	var acc openai.ChatCompletionAccumulator
	for stream.Next() {
		acc.AddChunk(stream.Current())
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	spec, _, out, _ := e.gov.last(t)
	want := newOutCounterOf(testModel, "Lisbon has seven hills.")
	if out.Usage.Reported || out.Counted < want || out.Usage.Completion != out.Counted || out.Usage.Prompt != spec.PromptTokens {
		t.Fatalf("outcome %+v, want estimated with ≥ %d", out, want)
	}
	if acc.Usage.CompletionTokens != out.Counted {
		t.Fatalf("client told %+v", acc.Usage)
	}
}

// A malformed line ends the stream well formed (an error event the
// official reader surfaces, then [DONE]); what passed is charged.
func TestMalformedSSELine(t *testing.T) {
	for _, bad := range []string{"data: {not json", `data: {"error":{"message":"overloaded"}}`} {
		up := newScripted(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
			sse(w, chunkJSON("Lisbon has"), chunkJSON(" seven hills."), bad, chunkJSON(" never seen"))
		})
		e := newEnv(t, up.upstream(), nil)
		stream := e.client.Chat.Completions.NewStreaming(context.Background(), chatStreamParams(true))
		text := ""
		for stream.Next() {
			if ch := stream.Current(); len(ch.Choices) > 0 {
				text += ch.Choices[0].Delta.Content
			}
		}
		if stream.Err() == nil || text != "Lisbon has seven hills." {
			t.Fatalf("%q: err %v text %q", bad, stream.Err(), text)
		}
		_, _, out, err := e.gov.last(t)
		if !errors.Is(err, ErrUpstream) || !out.Started || out.Counted < newOutCounterOf(testModel, text) || out.Usage.Reported {
			t.Fatalf("%q: outcome %+v err %v", bad, out, err)
		}
		lines := rawSSE(t, e, "/v1/chat/completions", `{"model":"gpt-4o-mini","messages":[],"stream":true}`)
		if n := len(lines); lines[n-1] != "[DONE]" || !strings.Contains(lines[n-2], `"code":"model_unavailable"`) {
			t.Fatalf("raw ending %q", lines)
		}
	}
}

// A line over the bound is malformed, in bounded memory; a Responses
// stream that breaks ends with response.failed.
func TestLineOverBoundAndResponsesFailure(t *testing.T) {
	up := newScripted(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		w.Header().Set("Content-Type", "text/event-stream")
		responsesOpening(w)
		fmt.Fprintf(w, "data: {\"type\":\"response.output_text.delta\",\"sequence_number\":3,\"output_index\":0,\"delta\":\"%s\"}\n\n", strings.Repeat("x", 5000))
	})
	e := newEnv(t, up.upstream(), func(o *Options) { o.MaxEvent = 4096 })
	stream := e.client.Responses.NewStreaming(context.Background(), responses.ResponseNewParams{Model: testModel,
		Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("go on")}})
	var lastType string
	var final responses.Response
	for stream.Next() {
		ev := stream.Current()
		lastType = ev.Type
		if ev.Type == "response.failed" {
			final = ev.AsResponseFailed().Response
		}
	}
	if lastType != "response.failed" || final.Status != "failed" || final.Error.Code == "" {
		t.Fatalf("last event %q, final %+v, err %v", lastType, final, stream.Err())
	}
	_, _, out, err := e.gov.last(t)
	if !errors.Is(err, ErrUpstream) || !out.Started {
		t.Fatalf("outcome %+v err %v", out, err)
	}
}

// A provider that fails before a byte reached the client leaves the
// answer to the fallback; the client never sees the failure.
func TestBrokenBeforeStartFallsBack(t *testing.T) {
	for name, serve := range map[string]func(http.ResponseWriter, *http.Request, map[string]any){
		"malformed first event": func(w http.ResponseWriter, r *http.Request, _ map[string]any) { sse(w, "data: <html>") },
		"500":                   func(w http.ResponseWriter, r *http.Request, _ map[string]any) { w.WriteHeader(500) },
		"empty body":            func(w http.ResponseWriter, r *http.Request, _ map[string]any) {},
	} {
		primary := newScripted(t, serve)
		e := newEnv(t, primary.upstream(), nil)
		fb := offlineUpstream()
		e.gov.fallback = &fb
		p := chatStreamParams(true)
		stream := e.client.Chat.Completions.NewStreaming(context.Background(), p)
		var acc openai.ChatCompletionAccumulator
		for stream.Next() {
			acc.AddChunk(stream.Current())
		}
		if err := stream.Err(); err != nil || !strings.Contains(acc.Choices[0].Message.Content, "deterministic") {
			t.Fatalf("%s: err %v, answer %+v", name, err, acc.Choices)
		}
		_, a, out, err := e.gov.last(t)
		if !a.Fallback || err != nil || !out.Usage.Reported {
			t.Fatalf("%s: attempt %+v outcome %+v err %v", name, a, out, err)
		}
	}
}

// Reasoning is output: reasoning_content and reasoning deltas are counted
// with the content and cut alike.
func TestReasoningStreamCounted(t *testing.T) {
	thought := "Let me think about which hills to climb first and why"
	up := newScripted(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		var evs []string
		for _, f := range []string{"reasoning_content", "reasoning"} {
			for _, word := range strings.Fields(thought) {
				b, _ := json.Marshal(map[string]any{"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "deepseek-r1",
					"choices": []any{map[string]any{"index": 0, "delta": map[string]any{f: word + " "}}}})
				evs = append(evs, "data: "+string(b))
			}
		}
		evs = append(evs, chunkJSON("Start at Graça."), "data: [DONE]")
		sse(w, evs...)
	})
	e := newEnv(t, up.upstream(), nil)
	e.gov.model = "deepseek-r1" // no known tokenizer: the bound
	lines := rawSSE(t, e, "/v1/chat/completions", `{"model":"gpt-4o-mini","messages":[],"stream":true}`)
	_, _, out, _ := e.gov.last(t)
	all := strings.Repeat(strings.Join(strings.Fields(thought), " ")+" ", 2) + "Start at Graça."
	if want := newOutCounterOf("deepseek-r1", all); out.Counted != want || out.Truncated {
		t.Fatalf("counted %d, want %d (reasoning included)", out.Counted, want)
	}
	if lines[len(lines)-1] != "[DONE]" {
		t.Fatal("no [DONE]")
	}
	// Cut inside the reasoning.
	e.gov.cap = 10
	lines = rawSSE(t, e, "/v1/chat/completions", `{"model":"gpt-4o-mini","messages":[],"stream":true}`)
	_, _, out, _ = e.gov.last(t)
	if !out.Truncated || out.Counted > 10 || strings.Contains(strings.Join(lines, ""), "Graça") {
		t.Fatalf("reasoning cut: outcome %+v", out)
	}
}

// A legacy function_call (the answer to a request with functions, passed
// through) is counted and cut as tool calls are: a provider that streams
// its arguments past the reservation is stopped.
func TestLegacyFunctionCallCounted(t *testing.T) {
	args := strings.Repeat(`{\"city\":\"Lisbon\"},`, 40)
	up := newScripted(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		evs := []string{`data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{"role":"assistant","function_call":{"name":"weather","arguments":""}}}]}`}
		for range 20 {
			evs = append(evs, `data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{"function_call":{"arguments":"`+args+`"}}}]}`)
		}
		evs = append(evs, `data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{},"finish_reason":"function_call"}]}`, "data: [DONE]")
		sse(w, evs...)
	})
	e := newEnv(t, up.upstream(), nil)
	e.gov.cap = 50
	lines := rawSSE(t, e, "/v1/chat/completions", `{"model":"gpt-4o-mini","messages":[],"stream":true,"functions":[{"name":"weather"}]}`)
	// The first event of arguments is far past the reservation (50): it
	// is not relayed, and it is charged, as the provider sent it.
	_, _, out, _ := e.gov.last(t)
	if !out.Truncated || out.Counted <= 50+overTolerance(50, true) || strings.Contains(strings.Join(lines, ""), "Lisbon") {
		t.Fatalf("function_call stream: outcome %+v", out)
	}
	if lines[len(lines)-1] != "[DONE]" || !strings.Contains(strings.Join(lines, ""), `"finish_reason":"length"`) {
		t.Fatalf("the cut stream did not end as a cut: %q", lines[len(lines)-3:])
	}
}

// A provider that streams forever what is not counted (a vendor field of
// a chat delta, a Responses event without a delta) is cut by its bytes,
// as at its reservation, hung up on, and charged the whole reservation.
func TestUncountedStreamCutByBytes(t *testing.T) {
	pad := strings.Repeat("x", 1000)
	forever := func(event string) func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		return func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
			w.Header().Set("Content-Type", "text/event-stream")
			for i := 0; r.Context().Err() == nil && i < 100_000; i++ {
				_, _ = io.WriteString(w, "data: "+event+"\n\n")
				w.(http.Flusher).Flush()
			}
		}
	}
	for _, c := range []struct{ name, path, body, event, end string }{
		{"chat", "/v1/chat/completions", `{"model":"gpt-4o-mini","messages":[],"stream":true}`,
			`{"id":"c","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{"vendor_thoughts":"` + pad + `"}}]}`,
			`"finish_reason":"length"`},
		{"responses", "/v1/responses", `{"model":"gpt-4o-mini","input":"hi","stream":true}`,
			`{"type":"response.vendor.heartbeat","output_index":0,"pad":"` + pad + `"}`,
			`"status":"incomplete"`},
	} {
		t.Run(c.name, func(t *testing.T) {
			up := newScripted(t, forever(c.event))
			e := newEnv(t, up.upstream(), nil)
			e.gov.cap = 50
			// Read whole: the closing event carries the items that passed
			// (up to MaxEvent), longer than rawSSE's lines.
			_, whole := e.post(t, c.path, c.body)
			raw := []byte(whole)
			_, _, out, _ := e.gov.last(t)
			if !out.Truncated || out.Counted != 50 {
				t.Fatalf("not cut and charged the reservation (50): %+v after %d bytes", out, len(raw))
			}
			if bound := 50*streamBytesPerToken + streamBytesBase + 2*DefaultMaxEvent; len(raw) > bound {
				t.Fatalf("%d bytes relayed, over %d", len(raw), bound)
			}
			tail := raw[max(len(raw)-2*DefaultMaxEvent, 0):]
			if !bytes.Contains(tail, []byte(c.end)) {
				t.Fatalf("the stream did not end as a cut one: %.300q", tail[max(len(tail)-300, 0):])
			}
		})
	}
}

// A Responses stream echoes the request's instructions in its created,
// in-progress and closing events: a long system prompt under a small
// reservation is not mistaken for a stream of what is not counted.
func TestResponsesEchoIsNotCut(t *testing.T) {
	instructions := strings.Repeat("Answer in the voice of a patient tour guide. ", 9000) // ~400 KB
	echo, _ := json.Marshal(map[string]any{"id": "r", "object": "response", "status": "in_progress", "model": "gpt-4o-mini", "instructions": instructions, "output": []any{}})
	done, _ := json.Marshal(map[string]any{"id": "r", "object": "response", "status": "completed", "model": "gpt-4o-mini", "instructions": instructions, "output": []any{},
		"usage": map[string]any{"input_tokens": 90000, "output_tokens": 2, "total_tokens": 90002}})
	up := newScripted(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		sse(w,
			`data: {"type":"response.created","response":`+string(echo)+`}`,
			`data: {"type":"response.in_progress","response":`+string(echo)+`}`,
			`data: {"type":"response.output_text.delta","output_index":0,"content_index":0,"item_id":"m","delta":"Hello"}`,
			`data: {"type":"response.output_text.delta","output_index":0,"content_index":0,"item_id":"m","delta":" there"}`,
			`data: {"type":"response.completed","response":`+string(done)+`}`)
	})
	e := newEnv(t, up.upstream(), nil)
	e.gov.cap = 16
	body, _ := json.Marshal(map[string]any{"model": "gpt-4o-mini", "instructions": instructions, "input": "hi", "stream": true})
	_, whole := e.post(t, "/v1/responses", string(body))
	raw := []byte(whole)
	_, _, out, _ := e.gov.last(t)
	if out.Truncated || !bytes.Contains(raw, []byte(`"type":"response.completed"`)) {
		t.Fatalf("an echoing stream of %d bytes under a 16-token reservation was cut: %+v", len(raw), out)
	}
}

// A client that leaves half way: the provider has the prompt and goes on
// generating, so the stream is read on, relaying nothing, to its usage,
// within its reservation: an endless one is hung up on there and charged
// the whole of it, its ledger outcome client_closed.
func TestAbandonedStream(t *testing.T) {
	up := newScripted(t, endless("tick "))
	e := newEnv(t, up.upstream(), nil)
	// Far more than the socket's buffers hold in chunks of one token: the
	// relay cannot reach the cut before it learns of the hang-up (with
	// 300 it could, and the cut was then the limit's, not the agent's).
	const reserved = 20000
	e.gov.cap = reserved
	done := make(chan struct{})
	e.gov.done = done
	req, _ := http.NewRequest(http.MethodPost, e.srv.URL+"/v1/chat/completions", strings.NewReader(`{"model":"gpt-4o-mini","messages":[],"stream":true}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	rd := bufio.NewReader(resp.Body)
	seen := 0
	for seen < 50 {
		line, err := rd.ReadString('\n')
		if err != nil {
			t.Fatal(err)
		}
		if strings.HasPrefix(line, "data: ") {
			seen++
		}
	}
	resp.Body.Close()
	<-up.gone
	<-done
	_, _, out, _ := e.gov.last(t)
	if out.Counted != reserved || !out.Truncated || !out.Started || !out.Sent || out.Ended != budget.OutcomeClientClosed {
		t.Fatalf("outcome %+v after %d chunks read, want the reservation's %d counted, client_closed", out, seen, reserved)
	}
}

// A client that leaves while the provider is still answering: the stream
// is read on to its usage, which is charged as it would have been, and
// the ledger says client_closed. (The hang-up is the agent's request
// cancelled without a cause of faregate's, as net/http cancels it.)
func TestAbandonedStreamReadToItsUsage(t *testing.T) {
	release := make(chan struct{})
	up := newScripted(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		sse(w, chunkJSON("The first"), chunkJSON(" words"))
		<-release
		sse(w, chunkJSON(" and the rest."), `data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":6,"total_tokens":15}}`, "data: [DONE]")
	})
	e := newEnv(t, up.upstream(), nil)
	hangUp := make(chan context.CancelFunc, 1)
	inner := e.srv.Config.Handler
	e.srv.Config.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithCancel(r.Context())
		defer cancel()
		hangUp <- cancel
		inner.ServeHTTP(w, r.WithContext(ctx))
	})
	done := make(chan struct{})
	e.gov.done = done
	req, _ := http.NewRequest(http.MethodPost, e.srv.URL+"/v1/chat/completions", strings.NewReader(`{"model":"gpt-4o-mini","messages":[],"stream":true}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if line, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil || !strings.Contains(line, "The first") {
		t.Fatalf("first line %q %v", line, err)
	}
	(<-hangUp)()
	close(release)
	<-done
	_, _, out, err := e.gov.last(t)
	if err != nil || !out.Usage.Reported || out.Usage.Completion != 6 || out.Ended != budget.OutcomeClientClosed || !out.Sent {
		t.Fatalf("outcome %+v err %v, want the provider's usage (6), client_closed", out, err)
	}
}

// The task ending cancels the request's context: the stream is cut,
// ends well formed, and the provider is hung up on.
func TestTaskEndCutsStream(t *testing.T) {
	up := newScripted(t, endless("tick "))
	var end context.CancelFunc
	ready := make(chan struct{})
	e := newEnv(t, up.upstream(), nil)
	inner := e.srv.Config.Handler
	e.srv.Config.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithCancelCause(r.Context())
		end = func() { cancel(errTaskOver) }
		close(ready)
		inner.ServeHTTP(w, r.WithContext(ctx))
	})
	e.gov.cap = 1 << 30
	stream := e.client.Chat.Completions.NewStreaming(context.Background(), chatStreamParams(true))
	var acc openai.ChatCompletionAccumulator
	n := 0
	for stream.Next() {
		acc.AddChunk(stream.Current())
		if n++; n == 20 {
			<-ready
			end()
		}
	}
	if err := stream.Err(); err != nil || acc.Choices[0].FinishReason != "length" || acc.Usage.CompletionTokens == 0 {
		t.Fatalf("err %v finish %q usage %+v", err, acc.Choices[0].FinishReason, acc.Usage)
	}
	<-up.gone
	_, _, out, _ := e.gov.last(t)
	if !out.Truncated || out.Counted != acc.Usage.CompletionTokens || out.Ended != budget.OutcomeTaskEnded || !out.Sent {
		t.Fatalf("outcome %+v", out)
	}
}

// errTaskOver stands for the cause the task key's watch cancels a request
// with when its task ends (taskkey.ErrFinished).
var errTaskOver = errors.New("test: the task ended")

func TestJSONAnswers(t *testing.T) {
	var answer string
	var status int
	up := newScripted(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_, _ = io.WriteString(w, answer)
	})
	e := newEnv(t, up.upstream(), func(o *Options) { o.MaxAnswer = 4096 })
	body := `{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}`

	status, answer = 200, `{"id":"x","object":"chat.completion","model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"Seven hills.","reasoning_content":"Count them.","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}}]},"finish_reason":"stop"}],"vendor":{"x":1}}`
	r, b := e.post(t, "/v1/chat/completions", body)
	if r.StatusCode != 200 || b != answer {
		t.Fatalf("the answer was not relayed byte for byte: %d %s", r.StatusCode, b)
	}
	spec, _, out, _ := e.gov.last(t)
	want := newOutCounterOf(testModel, "Seven hills.") + newOutCounterOf(testModel, "Count them.") + newOutCounterOf(testModel, "f") + newOutCounterOf(testModel, `{"a":1}`)
	if out.Usage.Reported || out.Counted != want || out.Usage.Completion != want || out.Usage.Prompt != spec.PromptTokens {
		t.Fatalf("report-less answer: outcome %+v, want %d", out, want)
	}

	answer = `{"choices":[{"message":{"content":"ok"}}],"usage":{"prompt_tokens":1e30,"completion_tokens":-5,"completion_tokens_details":{"reasoning_tokens":7}}}`
	e.post(t, "/v1/chat/completions", body)
	_, _, out, _ = e.gov.last(t)
	if !out.Usage.Reported || out.Usage.Prompt != 1<<62 || out.Usage.Completion != 2 || !strings.Contains(out.Usage.Raw, "1e30") {
		t.Fatalf("hostile numbers are bounded and passed on with the raw report: %+v", out.Usage)
	}
	if out.Usage.Reasoning != 2 {
		t.Fatalf("reasoning %d of %d output tokens; want all of them, never more", out.Usage.Reasoning, out.Usage.Completion)
	}
	answer = `{"choices":[{"message":{"content":"ok"}}],"usage":{"prompt_tokens":10,"completion_tokens":50,"completion_tokens_details":{"reasoning_tokens":30}}}`
	e.post(t, "/v1/chat/completions", body)
	if _, _, out, _ = e.gov.last(t); out.Usage.Reasoning != 30 || out.Usage.Completion != 50 {
		t.Fatalf("reasoning for the ledger: %+v", out.Usage)
	}

	// The bound is the reservation's, as a stream's: 4 KiB a reserved
	// token and 1 MiB, and the request's echo.
	e.gov.cap = 1
	answer = `{"choices":[{"message":{"content":"` + strings.Repeat("x", streamBytesBase+streamBytesPerToken+4*len(body)) + `"}}]}`
	if r, b := e.post(t, "/v1/chat/completions", body); r.StatusCode != 502 {
		t.Fatalf("answer over the bound: %d %.200s", r.StatusCode, b)
	}
	if _, _, out, err := e.gov.last(t); !errors.Is(err, ErrUpstreamAnswer) || out.Counted != 1 {
		t.Fatalf("answer over the bound: outcome %+v err %v, want the reservation counted", out, err)
	}
	e.gov.cap = 1000
	for _, c := range []struct {
		status int
		code   string
		want   int
	}{{400, "invalid_request", 400}, {422, "invalid_request", 400}, {500, "model_unavailable", 503}, {429, "model_unavailable", 503}, {401, "model_unavailable", 503}} {
		status, answer = c.status, `{"error":{"message":"secret org-123 details"}}`
		r, b := e.post(t, "/v1/chat/completions", body)
		code, _, _ := errorOf(t, b)
		if r.StatusCode != c.want || code != c.code || strings.Contains(b, "org-123") {
			t.Fatalf("upstream %d: %d %s", c.status, r.StatusCode, b)
		}
	}
	status, answer = 200, `not json`
	if r, _ := e.post(t, "/v1/chat/completions", body); r.StatusCode != 503 {
		t.Fatalf("an answer that is not JSON: %d", r.StatusCode)
	}
	// The governor's refusals pass through unchanged.
	e.gov.refuse = errBudget
	r, b = e.post(t, "/v1/chat/completions", body)
	if code, typ, _ := errorOf(t, b); r.StatusCode != 429 || code != "demo_budget_exhausted" || typ != "insufficient_quota" || r.Header.Get("X-Should-Retry") != "false" {
		t.Fatalf("governor refusal: %d %s", r.StatusCode, b)
	}
}

// The task ending before the provider answered: 409 task_finished, and
// the provider is hung up on.
func TestTaskEndBeforeAnswer(t *testing.T) {
	up := newScripted(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) { <-r.Context().Done() })
	e := newEnv(t, up.upstream(), nil)
	inner := e.srv.Config.Handler
	e.srv.Config.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithCancelCause(r.Context())
		defer cancel(nil)
		go func() {
			// The task ends once the provider holds the call (or after
			// 10 s: the test fails below, never through t from here).
			clocktest.Poll(10*time.Second, func() bool {
				up.mu.Lock()
				defer up.mu.Unlock()
				return len(up.bodies) > 0
			})
			cancel(errTaskOver)
		}()
		inner.ServeHTTP(w, r.WithContext(ctx))
	})
	r, b := e.post(t, "/v1/chat/completions", `{"model":"gpt-4o-mini","messages":[]}`)
	if code, _, _ := errorOf(t, b); r.StatusCode != 409 || code != "task_finished" {
		t.Fatalf("%d %s", r.StatusCode, b)
	}
	up.mu.Lock()
	got := len(up.bodies)
	up.mu.Unlock()
	if got == 0 {
		t.Fatal("the provider never got the call")
	}
	<-up.gone
	// The provider had the request: a JSON call is charged its whole
	// reservation (nothing of the answer could be counted).
	_, a, out, _ := e.gov.last(t)
	if !out.Sent || out.Ended != budget.OutcomeTaskEnded || out.Counted != a.MaxOutput || out.Usage.Prompt < 1 {
		t.Fatalf("outcome %+v, want the reservation (%d) charged, task_ended", out, a.MaxOutput)
	}
}

// A provider's own response.failed after the stream started is relayed as
// sent, and the attempt reports a provider failure for the breaker.
func TestResponsesProviderFailedRelayed(t *testing.T) {
	up := newScripted(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		w.Header().Set("Content-Type", "text/event-stream")
		seq := responsesOpening(w)
		fmt.Fprintf(w, "data: {\"type\":\"response.output_text.delta\",\"sequence_number\":%d,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"delta\":\"Hi\"}\n\n", seq)
		fmt.Fprintf(w, "data: {\"type\":\"response.failed\",\"sequence_number\":%d,\"response\":{\"id\":\"resp_1\",\"status\":\"failed\",\"error\":{\"code\":\"server_error\",\"message\":\"x\"},\"usage\":{\"input_tokens\":5,\"output_tokens\":1}}}\n\n", seq+1)
	})
	e := newEnv(t, up.upstream(), nil)
	stream := e.client.Responses.NewStreaming(context.Background(), responses.ResponseNewParams{Model: testModel,
		Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("go on")}})
	var last string
	for stream.Next() {
		last = stream.Current().Type
	}
	if last != "response.failed" {
		t.Fatalf("last event %q (err %v)", last, stream.Err())
	}
	_, _, out, err := e.gov.last(t)
	if !errors.Is(err, ErrUpstream) || !out.Started || !out.Usage.Reported || out.Usage.Completion != 1 {
		t.Fatalf("outcome %+v err %v", out, err)
	}
}

// The line reader's buffer is held for a stream's life: an ordinary
// stream of small events keeps it at its start size, one long event grows
// it only as far as that event needs, and an event over the bound still
// fails (the bound is unchanged).
func TestLineReaderGrowsOnlyAsNeeded(t *testing.T) {
	event := `data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{"content":"word "}}]}` + "\n\n"
	rd := newSSEReader(strings.NewReader(strings.Repeat(event, 200)), DefaultMaxEvent)
	for range 200 {
		if _, err := rd.next(); err != nil {
			t.Fatal(err)
		}
	}
	if c := cap(rd.lr.buf); c > 1<<10 {
		t.Fatalf("small events held a %d-byte buffer", c)
	}

	long := "data: " + strings.Repeat("x", 10_000) + "\n\n"
	rd = newSSEReader(strings.NewReader(long+event), DefaultMaxEvent)
	for range 2 {
		if _, err := rd.next(); err != nil {
			t.Fatal(err)
		}
	}
	if c := cap(rd.lr.buf); c < 10_000 || c > 32<<10 {
		t.Fatalf("a 10 kB event left a %d-byte buffer", c)
	}

	rd = newSSEReader(strings.NewReader("data: "+strings.Repeat("x", 5000)+"\n\n"), 4096)
	if _, err := rd.next(); !errors.Is(err, errLineTooLong) {
		t.Fatalf("an event over the bound: %v", err)
	}
}

// An open stream holds nothing of its prompt: neither the client's body
// (parsed, counted, then never encoded again once the answer started) nor
// the patched copy sent upstream (the transport keeps the request as long
// as the answer). Four streams of a 1 MiB prompt, chat and Responses,
// held 8 MiB of it before.
func TestOpenStreamHoldsNoPrompt(t *testing.T) {
	release := make(chan struct{})
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		if strings.HasSuffix(r.URL.Path, "/responses") {
			responsesOpening(w)
		} else {
			_, _ = io.WriteString(w, chunkJSON("first ")+"\n\n")
		}
		w.(http.Flusher).Flush()
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer up.Close()
	// Before the provider closes: the streams the clients left are read
	// on to their end (the provider has their prompts).
	defer close(release)
	const model = "llama-test" // counted with the bound: fast on a MiB
	e := newEnv(t, Upstream{BaseURL: up.URL + "/v1", Client: up.Client()}, nil)
	e.task.Models = []string{model}
	prompt := strings.Repeat("word ", 1<<20/5)
	bodies := map[string][]byte{
		"/v1/chat/completions": []byte(`{"model":"` + model + `","stream":true,"messages":[{"role":"user","content":"` + prompt + `"}]}`),
		"/v1/responses":        []byte(`{"model":"` + model + `","stream":true,"input":"` + prompt + `"}`),
	}
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	for path, body := range bodies {
		t.Run(path, func(t *testing.T) {
			const n = 4
			base := heapInUse()
			var open []io.Closer
			for range n {
				// The client's body is the one slice made before base.
				req, _ := http.NewRequest(http.MethodPost, e.srv.URL+path, bytes.NewReader(body))
				req.Header.Set("Content-Type", "application/json")
				resp, err := client.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				open = append(open, resp.Body)
				if resp.StatusCode != http.StatusOK {
					t.Fatalf("status %d", resp.StatusCode)
				}
				if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
					t.Fatal(err)
				}
			}
			held := heapInUse() - base
			for _, c := range open {
				c.Close()
			}
			if held > n*int64(len(body))/2 {
				t.Fatalf("%d open streams of a %d-byte prompt hold %d bytes", n, len(body), held)
			}
		})
	}
}

// heapInUse is the heap in use after a collection.
func heapInUse() int64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapInuse)
}
