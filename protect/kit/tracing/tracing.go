// Package tracing is the little OpenTelemetry glue faregate's packages
// share: spans that cost nothing while tracing is off (a nil trace.Tracer),
// the W3C traceparent a task carries across the queue to whichever replica
// runs it, and the trace ids that log lines carry. It needs only the
// OpenTelemetry API; the SDK and the exporter are wired in cmd/faregate.
package tracing

import (
	"context"
	"log/slog"
	"net/http"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// off is the span Start hands out while tracing is off: one shared value,
// so the off path allocates nothing.
var off trace.Span = noop.Span{}

// w3c is the W3C Trace Context propagator (traceparent and tracestate).
var w3c = propagation.TraceContext{}

// Start starts a span named name on t as a child of ctx's span. With a nil
// t (tracing off) it returns ctx as it is and a span that records nothing.
func Start(ctx context.Context, t trace.Tracer, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	if t == nil {
		return ctx, off
	}
	return t.Start(ctx, name, opts...)
}

// TraceParent is the W3C traceparent of ctx's span, "" when ctx has none.
// A task stores it when it is queued, so its run joins the trace of the
// request that admitted it.
func TraceParent(ctx context.Context) string {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return ""
	}
	c := propagation.MapCarrier{}
	w3c.Inject(ctx, c)
	return c["traceparent"]
}

// WithTraceParent returns ctx carrying the remote span that traceparent
// names, so spans started from it join that trace (and keep its sampling
// decision). An empty or malformed traceparent leaves ctx as it is.
func WithTraceParent(ctx context.Context, traceparent string) context.Context {
	if traceparent == "" {
		return ctx
	}
	return w3c.Extract(ctx, propagation.MapCarrier{"traceparent": traceparent})
}

// FromHeader returns ctx carrying the remote span that the request's
// traceparent (and tracestate) header names; ctx as it is without one.
func FromHeader(ctx context.Context, h http.Header) context.Context {
	return w3c.Extract(ctx, propagation.HeaderCarrier(h))
}

// LogAttrs are the trace_id and span_id of ctx's span for a log line, nil
// when ctx has no valid span: a line and its trace can be found from each
// other.
func LogAttrs(ctx context.Context) []slog.Attr {
	return SpanAttrs(trace.SpanContextFromContext(ctx))
}

// SpanAttrs are LogAttrs of a span context kept apart from any context
// (the access line is written after the request's span has ended).
func SpanAttrs(sc trace.SpanContext) []slog.Attr {
	if !sc.IsValid() {
		return nil
	}
	return []slog.Attr{slog.String("trace_id", sc.TraceID().String()), slog.String("span_id", sc.SpanID().String())}
}

// Logger is lg with the trace_id and span_id of ctx's span, for code that
// logs without a context (a task's run); lg itself when ctx has none.
func Logger(ctx context.Context, lg *slog.Logger) *slog.Logger {
	attrs := LogAttrs(ctx)
	if attrs == nil {
		return lg
	}
	return slog.New(lg.Handler().WithAttrs(attrs))
}
