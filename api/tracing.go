package api

import (
	"context"
	"log/slog"
	"net/http"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"faregate/protect/kit/tracing"
)

// Span attributes of faregate's own. Values are bounded: ids, codes and
// principals as logs name them (a key's id, a visitor's hash cut to 12
// hex); never an address.
const (
	attrRequestID = attribute.Key("faregate.request_id")
	attrPrincipal = attribute.Key("faregate.principal")
	attrCode      = attribute.Key("faregate.code")
)

// serverSpan gives every /api request one server span, which the gate's
// checks hang their own spans from. A traceparent header is believed only
// from a trusted proxy, like X-Request-Id: a visitor's own could choose
// the sampling decision or pile its requests into one trace. With tracing
// off (no Tracer) it is not in the chain at all.
func (s *server) serverSpan(next http.Handler) http.Handler {
	if s.d.Tracer == nil {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		st := stateOf(r)
		ctx := r.Context()
		if s.d.Visitors.TrustedPeer(r) {
			ctx = tracing.FromHeader(ctx, r.Header)
		}
		ctx, span := s.d.Tracer.Start(ctx, r.Method+" /api", trace.WithSpanKind(trace.SpanKindServer),
			trace.WithAttributes(semconv.HTTPRequestMethodKey.String(r.Method), attrRequestID.String(st.id)))
		st.span = span.SpanContext()
		defer func() {
			if v := recover(); v != nil {
				// The front middleware answers 500 and logs; the span only
				// has to end before the panic goes on up to it.
				span.SetStatus(codes.Error, "panic")
				span.End()
				panic(v)
			}
			endServerSpan(span, r, st)
		}()
		next.ServeHTTP(w, r.WithContext(ctx))
	})
}

// endServerSpan names the span after its route, now that routing is done,
// and records the answer.
func endServerSpan(span trace.Span, r *http.Request, st *state) {
	route := RoutePattern(r)
	status := st.status
	if status == 0 {
		status = http.StatusOK // what the front middleware will record
	}
	span.SetName(r.Method + " " + route)
	span.SetAttributes(semconv.HTTPRoute(route), semconv.HTTPResponseStatusCode(status),
		attrPrincipal.String(st.principalLabel()))
	if st.code != "" {
		span.SetAttributes(attrCode.String(st.code))
	}
	if status >= 500 {
		span.SetStatus(codes.Error, st.code)
	}
	span.End()
}

// span starts the span of one of the gate's checks as a child of ctx's;
// end records how the check answered (a refusal's code; an error status
// when a dependency failed, 5xx) and hands its error back, so a call can be
// wrapped as err = end(check(ctx)). With tracing off both cost nothing.
func (s *server) span(ctx context.Context, name string) (context.Context, func(error) error) {
	if s.d.Tracer == nil {
		return ctx, passErr
	}
	ctx, sp := s.d.Tracer.Start(ctx, name)
	return ctx, func(err error) error {
		if err != nil {
			spec := s.errors.lookup(err)
			sp.SetAttributes(attrCode.String(spec.code))
			if spec.status >= 500 {
				sp.SetStatus(codes.Error, spec.code)
			}
		}
		sp.End()
		return err
	}
}

func passErr(err error) error { return err }

// traceAttrs are the trace and span ids of the request's server span for
// its access line (none while tracing is off).
func (st *state) traceAttrs() []slog.Attr { return tracing.SpanAttrs(st.span) }
