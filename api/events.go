package api

import (
	"bytes"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/go-chi/chi/v5"

	"faregate/agent/task"
)

// handleTaskEvents streams a task's events as Server-Sent Events: every
// event from the first (or after Last-Event-ID), then live ones until done.
// Events are read from Redis, so any replica can serve any task.
func handleTaskEvents(d Deps) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id := chi.URLParam(r, "id")
		if _, err := d.Store.Get(r.Context(), id); err != nil {
			if errors.Is(err, task.ErrNotFound) {
				writeError(w, r, CodeTaskNotFound, 0, nil)
			} else {
				writeError(w, r, CodeProtectionDown, 0, nil)
			}
			return
		}
		after := r.Header.Get("Last-Event-ID")
		if after == "" {
			// EventSource cannot set headers on its first request; a client
			// resuming by hand may pass the id as a query parameter instead.
			after = r.URL.Query().Get("last_event_id")
		}
		if after != "" && !validStreamID(after) {
			writeError(w, r, CodeInvalidRequest, 0, map[string]string{"Last-Event-ID": "must be an event id from this stream"})
			return
		}

		rc := http.NewResponseController(w)
		// SSE outlives the server's write timeout by design.
		if err := rc.SetWriteDeadline(time.Time{}); err != nil {
			Logger(r.Context(), d.Logger).Warn("event stream keeps the write timeout", "err", err.Error())
		}
		h := w.Header()
		h.Set("Content-Type", "text/event-stream; charset=utf-8")
		h.Set("Cache-Control", "no-store")
		h.Set("X-Accel-Buffering", "no") // nginx: do not buffer the stream
		w.WriteHeader(http.StatusOK)
		// Tell EventSource how long to wait before it reconnects.
		fmt.Fprint(w, "retry: 2000\n\n")
		_ = rc.Flush()

		var buf bytes.Buffer
		err := d.Store.Follow(r.Context(), id, after, func(ev task.Event) error {
			buf.Reset()
			if ev.Type == task.EventKeepAlive {
				buf.WriteString(": keep-alive\n\n")
			} else {
				fmt.Fprintf(&buf, "id: %s\nevent: %s\n", ev.ID, ev.Type)
				for _, line := range bytes.Split(ev.Data, []byte("\n")) {
					fmt.Fprintf(&buf, "data: %s\n", line)
				}
				buf.WriteString("\n")
			}
			if _, err := w.Write(buf.Bytes()); err != nil {
				return err
			}
			return rc.Flush()
		})
		if err != nil && r.Context().Err() == nil {
			Logger(r.Context(), d.Logger).Warn("event stream ended early", "task", id, "err", err.Error())
		}
	})
}

// validStreamID accepts Redis stream ids ("1700000000000-0").
func validStreamID(s string) bool {
	if len(s) > 41 {
		return false
	}
	dash := false
	digits := 0
	for _, c := range s {
		switch {
		case c >= '0' && c <= '9':
			digits++
		case c == '-' && !dash && digits > 0:
			dash = true
			digits = 0
		default:
			return false
		}
	}
	return digits > 0
}
