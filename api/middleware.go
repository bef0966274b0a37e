package api

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"net/http"
	"strconv"
	"time"

	"faregate/protect/clientip"
)

type ctxKey int

const (
	requestIDKey ctxKey = iota
	loggerKey
)

// RequestID returns the request's id ("" outside a request).
func RequestID(ctx context.Context) string {
	id, _ := ctx.Value(requestIDKey).(string)
	return id
}

// Logger returns the request's logger, which carries its request id.
func Logger(ctx context.Context, fallback *slog.Logger) *slog.Logger {
	if lg, ok := ctx.Value(loggerKey).(*slog.Logger); ok {
		return lg
	}
	return fallback
}

// validRequestID accepts ids a proxy may hand us: short, and of characters
// that cannot break a header or a log line.
func validRequestID(s string) bool {
	if s == "" || len(s) > 128 {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.' || c == ':') {
			return false
		}
	}
	return true
}

func newRequestID() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// requestIDs gives every request an id: the trusted proxy's X-Request-Id
// when the peer is a trusted proxy and the id is sane, else a new one. The
// id goes into the response header, the context and the request's logger.
func requestIDs(visitors *clientip.Resolver, lg *slog.Logger, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id := r.Header.Get("X-Request-Id")
		if !validRequestID(id) || visitors == nil || !visitors.TrustedPeer(r) {
			id = newRequestID()
		}
		w.Header().Set("X-Request-Id", id)
		ctx := context.WithValue(r.Context(), requestIDKey, id)
		ctx = context.WithValue(ctx, loggerKey, lg.With("request_id", id))
		next.ServeHTTP(w, r.WithContext(ctx))
	})
}

// statusRecorder remembers the status for the access log and metrics, and
// still lets SSE flush.
type statusRecorder struct {
	http.ResponseWriter
	status int
	bytes  int64
}

func (s *statusRecorder) WriteHeader(code int) {
	if s.status == 0 {
		s.status = code
	}
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusRecorder) Write(b []byte) (int, error) {
	if s.status == 0 {
		s.status = http.StatusOK
	}
	n, err := s.ResponseWriter.Write(b)
	s.bytes += int64(n)
	return n, err
}

// Unwrap lets http.ResponseController reach Flush and deadlines.
func (s *statusRecorder) Unwrap() http.ResponseWriter { return s.ResponseWriter }

// accessLog logs one line per request (with its request id and the visitor's
// hash, never an address) and counts it by route pattern.
func accessLog(m *metrics, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		rec := &statusRecorder{ResponseWriter: w}
		next.ServeHTTP(rec, r)
		if rec.status == 0 {
			rec.status = http.StatusOK
		}
		route := RoutePattern(r)
		m.requests.WithLabelValues(route, r.Method, strconv.Itoa(rec.status)).Inc()
		attrs := []any{"method", r.Method, "route", route, "status", rec.status,
			"duration_ms", time.Since(start).Milliseconds(), "bytes", rec.bytes}
		if v, ok := clientip.FromContext(r.Context()); ok {
			attrs = append(attrs, "visitor", v.String())
		}
		lg := Logger(r.Context(), nil)
		if lg == nil {
			return
		}
		if route == "/healthz" || route == "/metrics" || route == "/readyz" {
			lg.Debug("request", attrs...)
			return
		}
		lg.Info("request", attrs...)
	})
}

// securityHeaders sets the page's CSP and the usual hardening headers on
// every response, API answers included.
func securityHeaders(csp string, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		if csp != "" {
			h.Set("Content-Security-Policy", csp)
		}
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Referrer-Policy", "strict-origin-when-cross-origin")
		h.Set("X-Frame-Options", "DENY")
		next.ServeHTTP(w, r)
	})
}

// recoverer turns a handler panic into a logged 500 envelope instead of a
// dropped connection.
func recoverer(lg *slog.Logger, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer func() {
			if v := recover(); v != nil {
				if v == http.ErrAbortHandler {
					panic(v)
				}
				Logger(r.Context(), lg).Error("handler panic", "panic", v)
				writeError(w, r, CodeInternal, 0, nil)
			}
		}()
		next.ServeHTTP(w, r)
	})
}

// ContextLogHandler adds the request id found in a log call's context, so
// packages that log with slog's *Context methods (the AITF guard) tag their
// lines with the request too, without knowing about this package.
func ContextLogHandler(h slog.Handler) slog.Handler { return ctxHandler{h} }

type ctxHandler struct{ slog.Handler }

func (c ctxHandler) Handle(ctx context.Context, r slog.Record) error {
	if id := RequestID(ctx); id != "" {
		r.AddAttrs(slog.String("request_id", id))
	}
	return c.Handler.Handle(ctx, r)
}

func (c ctxHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return ctxHandler{c.Handler.WithAttrs(as)}
}
func (c ctxHandler) WithGroup(n string) slog.Handler { return ctxHandler{c.Handler.WithGroup(n)} }
