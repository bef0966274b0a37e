package api

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/go-chi/chi/v5"

	"faregate/agent/task"
)

// streamRetry is the Retry-After of a refused stream: streams end within
// the maximum lifetime, and most much sooner, when their task is done.
const streamRetry = 5 * time.Second

// streamCaps bounds concurrent event streams per principal and per process.
// Streams are counted in this process; the per-principal cap keeps one
// visitor from holding the process's streams, the process cap keeps the
// sum bounded.
type streamCaps struct {
	perPrincipal, max int

	mu    sync.Mutex
	by    map[string]int
	total int
}

func newStreamCaps(perPrincipal, max int) *streamCaps {
	return &streamCaps{perPrincipal: perPrincipal, max: max, by: map[string]int{}}
}

// acquire takes a stream slot for scope, or refuses with too_many_streams
// (the principal's cap) or server_busy (the process's).
func (c *streamCaps) acquire(scope string) (release func(), err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.perPrincipal > 0 && c.by[scope] >= c.perPrincipal {
		return nil, &retryError{ErrTooManyStreams, streamRetry}
	}
	if c.max > 0 && c.total >= c.max {
		return nil, &retryError{ErrServerBusy, streamRetry}
	}
	c.by[scope]++
	c.total++
	var once sync.Once
	return func() {
		once.Do(func() {
			c.mu.Lock()
			defer c.mu.Unlock()
			c.total--
			if n := c.by[scope] - 1; n > 0 {
				c.by[scope] = n
			} else {
				delete(c.by, scope)
			}
		})
	}, nil
}

// open reports the streams held now (metrics, tests).
func (c *streamCaps) open() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.total
}

// streamSlot takes one of the principal's and the process's stream slots
// (streamCaps) before the request window. The caps are known from memory,
// so a stream over them is refused without a Redis round trip and is not
// counted: a visitor opening thousands of streams at once cannot queue the
// gate's Redis pool for everyone else. The slot is held until the stream
// ends.
func (s *server) streamSlot(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		release, err := s.streams.acquire(stateOf(r).principal.Scope())
		if err != nil {
			s.writeErr(w, r, err)
			return
		}
		defer release()
		next.ServeHTTP(w, r)
	})
}

// handleTaskEvents streams a task's events as Server-Sent Events: every
// event from the first (or after Last-Event-ID), then live ones until done.
// A stream lives at most the configured maximum; then it ends without a
// done event and the client resumes with Last-Event-ID, on this replica or
// another. Events come from Redis, so any replica can serve any task.
func (s *server) handleTaskEvents() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		st := stateOf(r)
		after := r.Header.Get("Last-Event-ID")
		if after == "" {
			// EventSource cannot set headers on its first request; a client
			// resuming by hand may pass the id as a query parameter instead.
			after = r.URL.Query().Get("last_event_id")
		}
		if after != "" && !validStreamID(after) {
			s.writeErr(w, r, invalid("Last-Event-ID", "must be an event id from this stream"))
			return
		}
		id := chi.URLParam(r, "id")
		if _, err := s.d.Store.Get(r.Context(), id); err != nil {
			s.writeErr(w, r, err)
			return
		}

		rc := http.NewResponseController(w)
		// SSE outlives the server's write timeout by design.
		if err := rc.SetWriteDeadline(time.Time{}); err != nil {
			s.d.Logger.Warn("event stream keeps the write timeout", "request_id", st.id, "err", err.Error())
		}
		h := w.Header()
		h["Content-Type"] = hdrEventStream
		h["Cache-Control"] = hdrNoStore
		h["X-Accel-Buffering"] = hdrNo // nginx: do not buffer the stream
		h["X-Content-Type-Options"] = hdrNoSniff
		w.WriteHeader(http.StatusOK)
		// Tell the client how long to wait before it reconnects.
		_, _ = w.Write([]byte("retry: 2000\n\n"))
		_ = rc.Flush()

		ctx, cancel := context.WithTimeout(r.Context(), s.d.Limits.StreamMaxDuration)
		defer cancel()
		var buf bytes.Buffer
		err := s.d.Events.Follow(ctx, id, after, func(ev task.Event) error {
			buf.Reset()
			if ev.Type == task.EventKeepAlive {
				buf.WriteString(": keep-alive\n\n")
			} else {
				buf.WriteString("id: ")
				buf.WriteString(ev.ID)
				buf.WriteString("\nevent: ")
				buf.WriteString(ev.Type)
				buf.WriteByte('\n')
				for _, line := range bytes.Split(ev.Data, []byte("\n")) {
					buf.WriteString("data: ")
					buf.Write(line)
					buf.WriteByte('\n')
				}
				buf.WriteByte('\n')
			}
			if _, err := w.Write(buf.Bytes()); err != nil {
				return err
			}
			return rc.Flush()
		})
		switch {
		case err == nil, r.Context().Err() != nil:
		case errors.Is(err, context.DeadlineExceeded):
			// The stream's lifetime is up; the client resumes.
		default:
			s.d.Logger.Warn("event stream ended early", "request_id", st.id, "task", id, "err", err.Error())
		}
	})
}

var (
	hdrEventStream = []string{"text/event-stream; charset=utf-8"}
	hdrNo          = []string{"no"}
)

// validStreamID accepts Redis stream ids ("1700000000000-0", or a bare
// millisecond part).
func validStreamID(s string) bool {
	if len(s) == 0 || len(s) > 41 {
		return false
	}
	ms, seq, dash := strings.Cut(s, "-")
	if !digits(ms) {
		return false
	}
	return !dash || digits(seq)
}

func digits(s string) bool {
	if s == "" || len(s) > 20 {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}
