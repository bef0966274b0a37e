package api

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	"go.opentelemetry.io/otel/trace"

	"faregate/protect/clientip"
	"faregate/protect/connlimit"
	"faregate/protect/kit/randhex"
	"faregate/protect/principal"
	"faregate/protect/ratelimit"
)

// state is what the middleware learns about one request, in one place: the
// front middleware puts it into the context once and later stages fill it
// in, so the access log (which runs last) sees the visitor, the principal
// and the code even though they were decided deeper down.
type state struct {
	id        string
	start     time.Time
	visitor   clientip.Visitor
	principal principal.Principal
	// policy is the policy this request sees (one value for the whole
	// request, however a reload races it) and tier the principal's limits.
	policy Policy
	tier   principal.Tier
	// window is the request window's decision, for RateLimit headers.
	window ratelimit.GateDecision
	// code is the error code answered ("" for successes); err the error
	// that chose it (logged for 5xx only).
	code string
	err  error
	// admitted is the task id of a 202, for the one admission line.
	admitted string
	// route labels a request no route pattern names (the page's assets).
	route  string
	status int
	bytes  int64
	// span is the request's server span, for its access line.
	span trace.SpanContext

	// Allocated with the state, so a request costs one allocation for all
	// of them: the response recorder, the X-Request-Id header value, and
	// a creation's admission.
	rec   recorder
	idHdr [1]string
	adm   admission
}

type stateKey struct{}

// stateOf returns the request's state (nil outside the server).
func stateOf(r *http.Request) *state {
	st, _ := r.Context().Value(stateKey{}).(*state)
	return st
}

// RequestID returns the request's id ("" outside a request).
func RequestID(ctx context.Context) string {
	if st, ok := ctx.Value(stateKey{}).(*state); ok {
		return st.id
	}
	return ""
}

// validRequestID accepts ids a proxy may hand us: short, and of characters
// that cannot break a header, a log line or a JSON string.
func validRequestID(s string) bool {
	if s == "" || len(s) > 128 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.' || c == ':') {
			return false
		}
	}
	return true
}

// newRequestID is 96 random bits in hex. It names a request in logs and
// answers.
func newRequestID() string { return randhex.New(12) }

// recorder remembers the status and size for the access log and metrics,
// and still lets SSE flush (Unwrap reaches the connection's writer).
type recorder struct {
	http.ResponseWriter
	st *state
}

func (rw *recorder) WriteHeader(code int) {
	if rw.st.status == 0 {
		rw.st.status = code
	}
	rw.ResponseWriter.WriteHeader(code)
}

func (rw *recorder) Write(b []byte) (int, error) {
	if rw.st.status == 0 {
		rw.st.status = http.StatusOK
	}
	n, err := rw.ResponseWriter.Write(b)
	rw.st.bytes += int64(n)
	return n, err
}

// Unwrap lets http.ResponseController reach Flush and deadlines.
func (rw *recorder) Unwrap() http.ResponseWriter { return rw.ResponseWriter }

// front is the first middleware of every request: it gives the request an
// id (a trusted proxy's sane X-Request-Id, else a new one), resolves the
// visitor, answers connections over the limit, recovers panics, and when
// the handler is done counts and logs the request. Doing this in one place
// keeps the refusal path to one context value and one wrapper.
func (s *server) front(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		st := &state{start: time.Now()}
		if id := r.Header.Get("X-Request-Id"); id != "" && validRequestID(id) && s.d.Visitors.TrustedPeer(r) {
			st.id = id
		} else {
			st.id = newRequestID()
		}
		st.idHdr[0] = st.id
		w.Header()["X-Request-Id"] = st.idHdr[:]
		r = r.WithContext(context.WithValue(r.Context(), stateKey{}, st))
		st.rec = recorder{ResponseWriter: w, st: st}
		rw := &st.rec
		defer s.finish(rw, r, st)

		if connlimit.Refused(r.Context()) {
			// Over the connection limit: answer at once and close.
			w.Header()["Connection"] = hdrCloseConn
			s.writeErr(rw, r, &retryError{ErrServerBusy, retryAfterUnavailable})
			return
		}
		v, err := s.visitor(r)
		if err != nil {
			s.writeErr(rw, r, err)
			return
		}
		st.visitor = v
		next.ServeHTTP(rw, r)
	})
}

// connVisitor remembers the visitor of a connection whose peer is not a
// trusted proxy: every request on it comes from the same address, so its
// keyed hash is computed once per connection, not once per request.
type connVisitor struct {
	mu      sync.Mutex
	peer    string
	visitor clientip.Visitor
}

type connKey struct{}

// ConnContext gives each connection a slot for its visitor; install it as
// (part of) http.Server.ConnContext.
func ConnContext(ctx context.Context, _ net.Conn) context.Context {
	return context.WithValue(ctx, connKey{}, &connVisitor{})
}

// visitor resolves the request's visitor, from the connection's slot when
// the peer is the same untrusted one as before (a trusted proxy's requests
// each name their own visitor, so they are resolved every time).
func (s *server) visitor(r *http.Request) (clientip.Visitor, error) {
	cv, _ := r.Context().Value(connKey{}).(*connVisitor)
	if cv == nil {
		return s.d.Visitors.Visitor(r)
	}
	cv.mu.Lock()
	if cv.peer != "" && cv.peer == r.RemoteAddr {
		v := cv.visitor
		cv.mu.Unlock()
		return v, nil
	}
	cv.mu.Unlock()
	v, err := s.d.Visitors.Visitor(r)
	if err != nil || s.d.Visitors.TrustedPeer(r) {
		return v, err
	}
	cv.mu.Lock()
	cv.peer, cv.visitor = r.RemoteAddr, v
	cv.mu.Unlock()
	return v, nil
}

// finish recovers a panic into a 500, then counts and logs the request.
// Logging follows one rule: a refused request writes no line of its own at
// the default level (the summary counts it), 4xx and the 5xx that shed load
// or report an outage alike (summarised); an outage writes one line when
// its dependency's state changes (dependencies); successful reads log at
// debug; admissions, internal errors and any other 5xx log one line each.
func (s *server) finish(rw *recorder, r *http.Request, st *state) {
	if v := recover(); v != nil {
		if v == http.ErrAbortHandler {
			panic(v)
		}
		s.d.Logger.Error("handler panic", "request_id", st.id, "panic", v)
		if st.status == 0 {
			s.writeErr(rw, r, errPanic)
		}
	}
	if st.status == 0 {
		st.status = http.StatusOK
	}
	route := s.routes.of(r)
	took := time.Since(st.start)
	s.m.observe(route, r.Method, st.status, took)

	lg := s.d.Logger
	switch {
	case st.status >= 500 && !summarised(st.code):
		s.m.denials.WithLabelValues(st.code).Inc()
		lg.LogAttrs(context.Background(), slog.LevelWarn, "request failed", s.accessAttrs(r, st, route, took)...)
	case st.status >= 400:
		if dep := s.deps.failedBy(st.err); dep != nil && st.status >= 500 {
			dep.failed(st, st.err)
		}
		s.m.denials.WithLabelValues(st.code).Inc()
		var buf [80]byte
		s.summary.add(st.code, st.appendPrincipal(buf[:0]))
		if lg.Enabled(context.Background(), slog.LevelDebug) {
			lg.LogAttrs(context.Background(), slog.LevelDebug, "request refused", s.accessAttrs(r, st, route, took)...)
		}
	case st.admitted != "":
		lg.LogAttrs(context.Background(), slog.LevelInfo, "task admitted", s.accessAttrs(r, st, route, took)...)
	case r.Method == http.MethodGet || r.Method == http.MethodHead || r.Method == http.MethodOptions,
		isV1(r.URL.Path): // an agent's calls: dozens per task, its own steps record them
		if lg.Enabled(context.Background(), slog.LevelDebug) {
			lg.LogAttrs(context.Background(), slog.LevelDebug, "request", s.accessAttrs(r, st, route, took)...)
		}
	default:
		lg.LogAttrs(context.Background(), slog.LevelInfo, "request", s.accessAttrs(r, st, route, took)...)
	}
}

func (s *server) accessAttrs(r *http.Request, st *state, route string, took time.Duration) []slog.Attr {
	attrs := []slog.Attr{
		slog.String("request_id", st.id),
		slog.String("method", r.Method),
		slog.String("route", route),
		slog.Int("status", st.status),
		slog.Int64("duration_ms", took.Milliseconds()),
		slog.Int64("bytes", st.bytes),
		slog.String("principal", st.principalLabel()),
	}
	if st.code != "" {
		attrs = append(attrs, slog.String("code", st.code))
	}
	if st.admitted != "" {
		attrs = append(attrs, slog.String("task", st.admitted))
	}
	attrs = append(attrs, st.traceAttrs()...)
	if st.status >= 500 && st.err != nil {
		// Errors of this program's own dependencies; never a client's text,
		// and never an address (Redis errors name its address, not a visitor's).
		attrs = append(attrs, slog.String("err", st.err.Error()))
	}
	return attrs
}

// principalLabel names the request's principal for logs: a key's id, or the
// visitor's truncated hash; never an address.
func (st *state) principalLabel() string { return string(st.appendPrincipal(nil)) }

// appendPrincipal appends principalLabel to b.
func (st *state) appendPrincipal(b []byte) []byte {
	p := st.principal
	if p.Kind == "" {
		p = principal.Principal{Kind: principal.KindVisitor, ID: st.visitor.Key()}
	}
	return p.AppendText(b)
}

// errPanic is what a recovered panic is answered as.
var errPanic = &panicError{}

type panicError struct{}

func (*panicError) Error() string { return "api: handler panicked" }

// statusClass is "2xx", "4xx"... for metric labels.
func statusClass(status int) string {
	if status < 100 || status > 599 {
		return "other"
	}
	return statusClasses[status/100]
}

var statusClasses = [6]string{"0xx", "1xx", "2xx", "3xx", "4xx", "5xx"}

// statusText is the status as a label, without allocating for the codes
// this server answers with.
func statusText(status int) string {
	if status >= 100 && status < 600 {
		return statusTexts[status]
	}
	return strconv.Itoa(status)
}

var statusTexts = func() (out [600]string) {
	for i := 100; i < 600; i++ {
		out[i] = strconv.Itoa(i)
	}
	return out
}()
