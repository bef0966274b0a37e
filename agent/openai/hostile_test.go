package openai

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"

	"faregate/agent/chat"
)

// reasoningServer streams n chunks of size bytes of delta.reasoning_content
// (as DeepSeek-style reasoning models do), then a line of content, and
// counts the chunks it got out before the client went away.
func reasoningServer(t *testing.T, n, size int, field string, sent *atomic.Int64) *server {
	thought := strings.Repeat("step by step ", size/13)
	return newServer(t, func(w http.ResponseWriter, req wireRequest) {
		w.Header().Set("Content-Type", "text/event-stream")
		fl := w.(http.Flusher)
		b, _ := json.Marshal(map[string]any{"id": "r", "choices": []any{map[string]any{"index": 0, "delta": map[string]any{field: thought}}}})
		for range n {
			if _, err := fmt.Fprintf(w, "data: %s\n\n", b); err != nil {
				return
			}
			fl.Flush()
			sent.Add(1)
		}
		fmt.Fprint(w, `data: {"id":"r","choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":"stop"}]}`+"\n\n")
		fmt.Fprint(w, "data: [DONE]\n\n")
	})
}

// TestReasoningCountedAndCut: reasoning deltas (reasoning_content, and
// reasoning as other servers name it) reach the stream as output, so the
// caller's cap counts and cuts them like content; after the cut nothing
// more is read.
func TestReasoningCountedAndCut(t *testing.T) {
	for _, field := range []string{"reasoning_content", "reasoning"} {
		t.Run(field, func(t *testing.T) {
			var sent atomic.Int64
			s := reasoningServer(t, 2000, 65000, field, &sent)
			m := model(t, s, Options{})
			var counted chat.Counter
			cut := errors.New("cut")
			const limit = 50000 // tokens: a few 65 KB chunks
			_, err := m.Generate(context.Background(), chat.Turn{Messages: []chat.Message{chat.Text(chat.RoleUser, "think")}, MaxTokens: limit,
				Stream: func(ch chat.Chunk) error {
					if ch.Text != "" {
						t.Errorf("reasoning arrived as text")
					}
					counted.Add(ch.Reasoning)
					if counted.Tokens() >= limit {
						return cut
					}
					return nil
				}})
			if !errors.Is(err, cut) {
				t.Fatalf("Generate = %v; want the stream's cut", err)
			}
			if counted.Tokens() < limit {
				t.Fatalf("counted %d reasoning tokens; want the limit %d", counted.Tokens(), limit)
			}
			if n := sent.Load(); n >= 2000 {
				t.Fatalf("the server sent all %d chunks: the cut did not stop reading", n)
			}
			t.Logf("%s: cut after %d tokens; the server got out %d of 2000 chunks of 65 KB", field, counted.Tokens(), sent.Load())
		})
	}
}

// TestReasoningMemoryBounded: a call whose stream never cuts reads 13 MB
// of reasoning, hands all of it to the stream, and keeps none of it:
// langchaingo, left alone, concatenates reasoning_content into one string
// chunk by chunk, allocating O(n²) (1,347 MB here before the fix) and
// holding all of it.
func TestReasoningMemoryBounded(t *testing.T) {
	var sent atomic.Int64
	const chunks, size = 200, 65000
	s := reasoningServer(t, chunks, size, "reasoning_content", &sent)
	m := model(t, s, Options{})
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	var counted chat.Counter
	reply, err := m.Generate(context.Background(), chat.Turn{Messages: []chat.Message{chat.Text(chat.RoleUser, "think")}, MaxTokens: 100,
		Stream: func(ch chat.Chunk) error { counted.Add(ch.Reasoning); return nil }})
	runtime.ReadMemStats(&after)
	if err != nil || reply.Content != "ok" {
		t.Fatalf("Generate = %+v, %v", reply, err)
	}
	alloc := after.TotalAlloc - before.TotalAlloc
	// Reading and re-encoding a line allocates a few times its size; the
	// server's side of the test writes its 13 MB too.
	if alloc > 150<<20 {
		t.Fatalf("the call allocated %d MB for %d MB of reasoning; want it bounded by its lines, not their sum's square", alloc>>20, chunks*size>>20)
	}
	if counted.Tokens() < chunks*size/4/2 {
		t.Fatalf("the stream was handed %d reasoning tokens of %d MB", counted.Tokens(), chunks*size>>20)
	}
	t.Logf("%d MB of reasoning read (%d tokens counted) with %d MB allocated in all", chunks*size>>20, counted.Tokens(), alloc>>20)
}

// TestLargeJSONAnswerParsed: a non-streamed answer of 1 MB content with
// its usage is read whole (it was thrown away as one SSE line too long for
// langchaingo's scanner, and the call charged 0), and its usage survives
// a cut at the caller's limit.
func TestLargeJSONAnswerParsed(t *testing.T) {
	content := strings.Repeat("a very long answer. ", 1<<20/20)
	s := newServer(t, func(w http.ResponseWriter, _ wireRequest) {
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(map[string]any{"id": "big", "object": "chat.completion",
			"choices": []any{map[string]any{"index": 0, "message": map[string]any{"role": "assistant", "content": content}, "finish_reason": "stop"}},
			"usage":   map[string]any{"prompt_tokens": 1000, "completion_tokens": 250000}})
	})
	m := model(t, s, Options{})
	reply, err := m.Generate(context.Background(), chat.Turn{Messages: []chat.Message{chat.Text(chat.RoleUser, "go")}, MaxTokens: 300000,
		Stream: func(chat.Chunk) error { return nil }})
	if err != nil || len(reply.Content) != len(content) {
		t.Fatalf("Generate = %d bytes, %v; want all %d", len(reply.Content), err, len(content))
	}
	if u := reply.Usage; !u.Reported || u.PromptTokens != 1000 || u.CompletionTokens != 250000 {
		t.Fatalf("usage %+v; want the reported 1000+250000", u)
	}
	cut := errors.New("cut")
	var n int
	reply, err = m.Generate(context.Background(), chat.Turn{Messages: []chat.Message{chat.Text(chat.RoleUser, "go")}, MaxTokens: 100,
		Stream: func(ch chat.Chunk) error {
			if n += len(ch.Text); n > 400 {
				return cut
			}
			return nil
		}})
	if !errors.Is(err, cut) || reply.Usage.CompletionTokens != 250000 {
		t.Fatalf("cut call: usage %+v, %v; want the stream's cut with the reported usage", reply.Usage, err)
	}
}

// TestUsageReadAsSent: a usage report is read as the provider wrote it;
// counts that are not 64-bit integers make it unreadable (they used to
// drop the whole chunk, content included), and the raw report is kept.
func TestUsageReadAsSent(t *testing.T) {
	cases := []struct {
		usage            string
		prompt, complete int64
		unreadable       bool
	}{
		{`{"prompt_tokens":9223372036854775807,"completion_tokens":1}`, 9223372036854775807, 1, false},
		{`{"prompt_tokens":-50000,"completion_tokens":-50000}`, -50000, -50000, false},
		{`{"prompt_tokens":12.0,"completion_tokens":3}`, 12, 3, false},
		{`{"prompt_tokens":9223372036854775808,"completion_tokens":1}`, 0, 0, true},
		{`{"prompt_tokens":1.5,"completion_tokens":1}`, 0, 0, true},
		{`{"prompt_tokens":"12","completion_tokens":1}`, 0, 0, true},
		{`{"prompt_tokens":12}`, 0, 0, true},
		{`{"prompt_tokens":1e999,"completion_tokens":1}`, 0, 0, true},
		{`[1,2]`, 0, 0, true},
	}
	for _, c := range cases {
		t.Run(c.usage, func(t *testing.T) {
			s := newServer(t, func(w http.ResponseWriter, _ wireRequest) {
				// The usage rides on the content chunk, as some servers send it.
				sse(w, `{"id":"u","choices":[{"index":0,"delta":{"content":"hello"},"finish_reason":"stop"}],"usage":`+c.usage+`}`)
			})
			reply, err := model(t, s, Options{}).Generate(context.Background(), chat.Turn{Messages: []chat.Message{chat.Text(chat.RoleUser, "go")},
				MaxTokens: 10, Stream: func(chat.Chunk) error { return nil }})
			if err != nil || reply.Content != "hello" {
				t.Fatalf("Generate = %+v, %v; want the content whatever the usage", reply, err)
			}
			u := reply.Usage
			if !u.Reported || u.Unreadable != c.unreadable || u.PromptTokens != c.prompt || u.CompletionTokens != c.complete || u.Raw != c.usage {
				t.Fatalf("usage %+v", u)
			}
		})
	}
}

// TestUnreadableAnswers: a 200 answer that is not a completion, or a line
// past the shim's bound, is ErrUnreadable: the caller charges at least
// the reservation rather than the nothing it parsed.
func TestUnreadableAnswers(t *testing.T) {
	cases := map[string]func(w http.ResponseWriter){
		"json that is not a completion": func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, `{"hello":"world"}`)
		},
		"json past the body bound": func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, `{"choices":[{"message":{"content":"`+strings.Repeat("x", maxShimBody)+`"}}]}`)
		},
		"text that is no stream": func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "text/plain")
			io.WriteString(w, "I am a teapot\n")
		},
		"an SSE line past the bound": func(w http.ResponseWriter) {
			sse(w, `{"id":"x","choices":[{"index":0,"delta":{"content":"`+strings.Repeat("y", maxLine)+`"}}]}`)
		},
	}
	for name, answer := range cases {
		t.Run(name, func(t *testing.T) {
			s := newServer(t, func(w http.ResponseWriter, _ wireRequest) { answer(w) })
			_, err := model(t, s, Options{}).Generate(context.Background(), chat.Turn{Messages: []chat.Message{chat.Text(chat.RoleUser, "go")},
				MaxTokens: 10, Stream: func(chat.Chunk) error { return nil }})
			if !errors.Is(err, chat.ErrUnreadable) {
				t.Fatalf("Generate = %v; want ErrUnreadable", err)
			}
		})
	}
}

// TestBillingFields: the reasoning part of a usage report is kept (never
// more than the output), and an error answer's HTTP status reaches the
// caller through HTTPStatus, for the ledger.
func TestBillingFields(t *testing.T) {
	s := newServer(t, func(w http.ResponseWriter, _ wireRequest) {
		sse(w, `{"id":"u","choices":[{"index":0,"delta":{"content":"hello"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":40,"completion_tokens_details":{"reasoning_tokens":25}}}`)
	})
	turn := chat.Turn{Messages: []chat.Message{chat.Text(chat.RoleUser, "go")}, MaxTokens: 10}
	reply, err := model(t, s, Options{}).Generate(context.Background(), turn)
	if err != nil || reply.Usage.ReasoningTokens != 25 {
		t.Fatalf("usage %+v, %v; want 25 reasoning tokens", reply.Usage, err)
	}
	for _, status := range []int{429, 503} {
		failing := newServer(t, func(w http.ResponseWriter, _ wireRequest) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(status)
			io.WriteString(w, `{"error":{"message":"busy","type":"server_error"}}`)
		})
		_, err := model(t, failing, Options{}).Generate(context.Background(), turn)
		var st interface{ HTTPStatus() int }
		if !errors.As(err, &st) || st.HTTPStatus() != status {
			t.Errorf("an error answer %d: %v carries no such status", status, err)
		}
	}
}
