package gateway

import (
	"net/http"
)

// sseWriter writes events to the client. Nothing is written before the
// first event, so a provider that fails before answering leaves the
// response free for an error (or the fallback's answer).
type sseWriter struct {
	w       http.ResponseWriter
	rc      *http.ResponseController
	started bool
	dirty   bool
	err     error
	buf     []byte
	// onStart runs when the first event goes out: the answer is
	// committed, no other attempt follows.
	onStart func()
}

func newSSEWriter(w http.ResponseWriter) *sseWriter {
	return &sseWriter{w: w, rc: http.NewResponseController(w)}
}

func (s *sseWriter) start() {
	if s.started {
		return
	}
	s.started = true
	if s.onStart != nil {
		s.onStart()
	}
	h := s.w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no") // proxies must not hold events back
	s.w.WriteHeader(http.StatusOK)
}

// send writes one event: an "event:" line when name is set, one data line.
// Data never holds a new line: it is a provider's JSON as parsed (which
// ends at its closing brace) or our own.
func (s *sseWriter) send(name string, data []byte) error {
	if s.err != nil {
		return s.err
	}
	s.start()
	b := s.buf[:0]
	if name != "" {
		b = append(b, "event: "...)
		b = append(b, name...)
		b = append(b, '\n')
	}
	b = append(b, "data: "...)
	b = append(b, data...)
	b = append(b, "\n\n"...)
	_, s.err = s.w.Write(b)
	if cap(b) <= 8<<10 {
		s.buf = b // reuse small buffers only: a huge event must not pin memory
	}
	s.dirty = true
	return s.err
}

// flush sends what was written; the relay calls it before it waits for the
// provider, so events leave as they arrive.
func (s *sseWriter) flush() {
	if !s.dirty || s.err != nil {
		return
	}
	s.dirty = false
	if err := s.rc.Flush(); err != nil && err != http.ErrNotSupported {
		s.err = err
	}
}

// compactJSON strips a provider's JSON of new lines inside white space, so
// it fits one data line. JSON strings cannot hold a raw new line, so every
// new line is white space between tokens.
func oneLine(data []byte) []byte {
	for i, c := range data {
		if c == '\n' || c == '\r' {
			out := make([]byte, 0, len(data))
			out = append(out, data[:i]...)
			for _, c := range data[i:] {
				if c != '\n' && c != '\r' {
					out = append(out, c)
				}
			}
			return out
		}
	}
	return data
}

// safeName reports whether an event name is fit to echo (the Responses
// event types: letters, digits, dots and underscores).
func safeName(s string) bool {
	if s == "" || len(s) > 128 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_') {
			return false
		}
	}
	return true
}
