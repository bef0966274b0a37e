package api

import (
	"context"
	"log/slog"

	"faregate/protect/kit/tracing"
)

// ContextLogHandler adds the request id and the trace and span ids found in
// a log call's context, so packages that log with slog's *Context methods
// (the AITF guard) tag their lines with the request too, without knowing
// about this package.
func ContextLogHandler(h slog.Handler) slog.Handler { return ctxHandler{h} }

type ctxHandler struct{ slog.Handler }

func (c ctxHandler) Handle(ctx context.Context, r slog.Record) error {
	if id := RequestID(ctx); id != "" {
		r.AddAttrs(slog.String("request_id", id))
	}
	r.AddAttrs(tracing.LogAttrs(ctx)...)
	return c.Handler.Handle(ctx, r)
}

func (c ctxHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return ctxHandler{c.Handler.WithAttrs(as)}
}
func (c ctxHandler) WithGroup(n string) slog.Handler { return ctxHandler{c.Handler.WithGroup(n)} }
