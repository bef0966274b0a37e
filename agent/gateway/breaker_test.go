package gateway

import (
	"errors"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"faregate/protect/breaker"
)

// TestProviderFactsForTheBreaker: what the provider answered reaches the
// breaker as a fault it judges (the status decides; a 429 carries its
// Retry-After), a refused connection as the transport's own error, and a
// stream's first bytes as its first event (a JSON answer has none).
func TestProviderFactsForTheBreaker(t *testing.T) {
	chat := `{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}`
	stream := `{"model":"gpt-4o-mini","stream":true,"messages":[{"role":"user","content":"hi"}]}`
	cases := []struct {
		name   string
		status int
		body   string
		fault  breaker.Fault
		after  time.Duration
	}{
		{"400: a parameter the provider refuses", 400, chat, breaker.CallerFault, 0},
		{"404", 404, chat, breaker.CallerFault, 0},
		{"409", 409, chat, breaker.CallerFault, 0},
		{"413", 413, stream, breaker.CallerFault, 0},
		{"422", 422, chat, breaker.CallerFault, 0},
		{"401: faregate's own credentials", 401, chat, breaker.ProviderFault, 0},
		{"408", 408, chat, breaker.ProviderFault, 0},
		{"429 with Retry-After", 429, stream, breaker.RateLimitFault, 3 * time.Second},
		{"503", 503, chat, breaker.ProviderFault, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			up := newScripted(t, func(w http.ResponseWriter, _ *http.Request, _ map[string]any) {
				if c.status == 429 {
					w.Header().Set("Retry-After", "3")
				}
				w.WriteHeader(c.status)
			})
			e := newEnv(t, up.upstream(), nil)
			var marks atomic.Int32
			e.gov.firstEvent = func() { marks.Add(1) }
			rawSSE(t, e, "/v1/chat/completions", c.body)
			_, _, _, err := e.gov.last(t)
			var j breaker.Judged
			if !errors.As(err, &j) || j.BreakerFault() != c.fault {
				t.Fatalf("err %v: want fault %d", err, c.fault)
			}
			var ra interface{ RetryAfter() time.Duration }
			if errors.As(err, &ra); ra == nil || ra.RetryAfter() != c.after {
				t.Fatalf("err %v: want Retry-After %v", err, c.after)
			}
			if wantInvalid := c.fault == breaker.CallerFault; errors.Is(err, ErrUpstreamInvalid) != wantInvalid {
				t.Fatalf("err %v: ErrUpstreamInvalid %v", err, !wantInvalid)
			}
			if n := marks.Load(); n != 0 {
				t.Fatalf("an error answer marked %d first events", n)
			}
		})
	}

	t.Run("a refused connection", func(t *testing.T) {
		dead := newScripted(t, nil)
		u := dead.upstream()
		dead.srv.Close()
		e := newEnv(t, u, nil)
		rawSSE(t, e, "/v1/chat/completions", chat)
		_, _, _, err := e.gov.last(t)
		var op *net.OpError
		if !errors.Is(err, ErrUpstream) || !errors.As(err, &op) {
			t.Fatalf("err %v: want ErrUpstream wrapping the transport's *net.OpError", err)
		}
	})

	t.Run("first bytes mark a stream, a JSON answer none", func(t *testing.T) {
		up := newScripted(t, func(w http.ResponseWriter, r *http.Request, body map[string]any) {
			if body["stream"] == true {
				sse(w, chunkJSON("Hello"), chunkJSON(" there"), "data: [DONE]")
				return
			}
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"id":"c","object":"chat.completion","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"Hello"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`))
		})
		e := newEnv(t, up.upstream(), nil)
		var marks atomic.Int32
		e.gov.firstEvent = func() { marks.Add(1) }
		if lines := rawSSE(t, e, "/v1/chat/completions", stream); len(lines) == 0 || !strings.Contains(strings.Join(lines, ""), "Hello") {
			t.Fatalf("stream: %q", lines)
		}
		if n := marks.Load(); n != 1 {
			t.Fatalf("a stream marked %d first events, want 1", n)
		}
		rawSSE(t, e, "/v1/chat/completions", chat)
		if _, _, _, err := e.gov.last(t); err != nil {
			t.Fatal(err)
		}
		if n := marks.Load(); n != 1 {
			t.Fatalf("a JSON answer marked a first event (%d in all)", n)
		}
	})
}
