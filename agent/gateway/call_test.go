package gateway

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"faregate/agent/tasklimits"
)

// countingLimiter counts its acquisitions and releases.
type countingLimiter struct{ acquired, released atomic.Int64 }

func (l *countingLimiter) Acquire(context.Context, tasklimits.Task, tasklimits.Kind) (func(context.Context, bool), error) {
	l.acquired.Add(1)
	return func(context.Context, bool) { l.released.Add(1) }, nil
}

// TestHeldSlotOnce: a call's slot is acquired once however many takes race
// for it, given back once, and a take after the give-back acquires
// nothing (it would be a slot no one releases).
func TestHeldSlotOnce(t *testing.T) {
	l := &countingLimiter{}
	var s heldSlot
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			if _, err := s.take(context.Background(), l, tasklimits.Task{ID: "t_held"}, tasklimits.Calls); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if got := l.acquired.Load(); got != 1 {
		t.Fatalf("16 racing takes acquired %d slots, want 1", got)
	}
	s.release(context.Background(), true)
	s.release(context.Background(), true)
	if got := l.released.Load(); got != 1 {
		t.Fatalf("released %d times, want 1", got)
	}
	if _, err := s.take(context.Background(), l, tasklimits.Task{ID: "t_held"}, tasklimits.Calls); !errors.Is(err, tasklimits.ErrUnavailable) {
		t.Fatalf("a take after the release: %v, want tasklimits.ErrUnavailable", err)
	}
	if got := l.acquired.Load(); got != 1 {
		t.Fatalf("a take after the release acquired again (%d)", got)
	}

	// Released before any take (the governor refused first): nothing to
	// give back, and nothing taken afterwards.
	var early heldSlot
	early.release(context.Background(), false)
	if _, err := early.take(context.Background(), l, tasklimits.Task{ID: "t_held2"}, tasklimits.Calls); err == nil || l.acquired.Load() != 1 {
		t.Fatalf("a take after an early release: %v, %d acquired", err, l.acquired.Load())
	}
}

// TestMinOutputCoversFallback: a Responses call to a local model (which
// takes max_output_tokens 1) whose fallback is an OpenAI model (which
// takes at least 16) is reserved for 16, so the fallback is never sent
// more than was reserved; without a fallback it stays at 1.
func TestMinOutputCoversFallback(t *testing.T) {
	for _, tc := range []struct {
		name      string
		fallbacks []string
		want      int64
	}{
		{"no fallback", nil, 1},
		{"local fallback", []string{"qwen2.5:7b"}, 1},
		{"OpenAI fallback", []string{"gpt-4o-mini"}, minOpenAIOutput},
	} {
		t.Run(tc.name, func(t *testing.T) {
			up := newScripted(t, func(w http.ResponseWriter, r *http.Request, body map[string]any) {
				w.Header().Set("Content-Type", "application/json")
				_, _ = io.WriteString(w, `{"id":"r","object":"response","status":"completed","model":"llama3.1:8b","output":[],"usage":{"input_tokens":3,"output_tokens":1,"total_tokens":4}}`)
			})
			e := newEnv(t, up.upstream(), func(o *Options) { o.FallbackModels = tc.fallbacks })
			e.task.Models = []string{"llama3.1:8b"}
			e.post(t, "/v1/responses", `{"model":"llama3.1:8b","input":"x","max_output_tokens":1}`)
			spec, _, _, _ := e.gov.last(t)
			if spec.MinOutput != tc.want || spec.MaxOutput != tc.want {
				t.Fatalf("MinOutput %d, MaxOutput %d; want both %d", spec.MinOutput, spec.MaxOutput, tc.want)
			}
			if got := up.lastBody(t)["max_output_tokens"]; got != float64(tc.want) {
				t.Fatalf("sent max_output_tokens %v, want %d", got, tc.want)
			}
		})
	}
}

// A call's images are reserved at the dearest of the asked and fallback
// models: a gpt-4o call that may fall back to gpt-4o-mini holds each image
// at gpt-4o-mini's 48,169 tokens, not gpt-4o's 1,445.
func TestImagesReservedForFallback(t *testing.T) {
	high := `{"model":"gpt-4o","messages":[{"role":"user","content":[{"type":"text","text":"what is it"},{"type":"image_url","image_url":{"url":"https://x/a.png"}},{"type":"image_url","image_url":{"url":"https://x/b.png"}}]}]}`
	low := strings.ReplaceAll(high, `.png"}`, `.png","detail":"low"}`)
	for _, tc := range []struct {
		name, body string
		fallbacks  []string
		least      int64
	}{
		{"no fallback", high, nil, 2 * 1445},
		{"gpt-4o-mini fallback", high, []string{"gpt-4o-mini"}, 2 * 48169},
		{"low detail, no fallback", low, nil, 2 * 85},
		{"low detail, gpt-4o-mini fallback", low, []string{"gpt-4o-mini"}, 2 * 2833},
	} {
		body := tc.body
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, okUpstream(t).upstream(), func(o *Options) { o.FallbackModels = tc.fallbacks })
			e.task.Models = []string{"gpt-4o"}
			if r, b := e.post(t, "/v1/chat/completions", body); r.StatusCode != 200 {
				t.Fatalf("%d %s", r.StatusCode, b)
			}
			spec, _, _, _ := e.gov.last(t)
			if spec.PromptTokens < tc.least || spec.PromptTokens > tc.least+200 {
				t.Fatalf("prompt reserved at %d tokens, want %d and its text", spec.PromptTokens, tc.least)
			}
		})
	}
}

// A Responses item reference is held at Options.ReferenceTokens (the
// binary's FAREGATE_LLM_MAX_TOKENS): the Vercel AI SDK sends each earlier
// answer as one, and the call goes ahead.
func TestItemReferenceHeld(t *testing.T) {
	up := newScripted(t, func(w http.ResponseWriter, r *http.Request, body map[string]any) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"r","object":"response","status":"completed","model":"gpt-4o-mini","output":[],"usage":{"input_tokens":3,"output_tokens":1,"total_tokens":4}}`)
	})
	e := newEnv(t, up.upstream(), func(o *Options) { o.ReferenceTokens = 3000 })
	if r, b := e.post(t, "/v1/responses", `{"model":"gpt-4o-mini","input":[{"role":"user","content":"hi"},{"type":"item_reference","id":"msg_1"},{"role":"user","content":"and then?"}]}`); r.StatusCode != 200 {
		t.Fatalf("%d %s", r.StatusCode, b)
	}
	spec, _, _, _ := e.gov.last(t)
	if spec.PromptTokens < 3000 || spec.PromptTokens > 3100 {
		t.Fatalf("prompt reserved at %d tokens, want 3,000 for the reference and its text", spec.PromptTokens)
	}
	if got := up.lastBody(t)["input"].([]any)[1].(map[string]any)["type"]; got != "item_reference" {
		t.Fatalf("the reference was not forwarded as sent: %v", got)
	}
}
