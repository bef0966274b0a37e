package govern

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	oteltrace "go.opentelemetry.io/otel/trace"

	"faregate/protect/budget"
)

// Span names of a governed call: stable, since dashboards and the tracing
// tests look for them. A call's model.call span is a child of its caller's
// (a task's run, a /v1 request), and its settle's budget.settle a child of
// the model.call.
const (
	spanModel  = "model.call"
	spanSettle = "budget.settle"
)

// Span attributes. The model, the operation and the token counts use the
// names of OpenTelemetry's GenAI conventions (still in development, so not
// in the semconv package this module uses); the rest are faregate's own.
const (
	attrGenAIOperation = attribute.Key("gen_ai.operation.name")
	attrGenAIModel     = attribute.Key("gen_ai.request.model")
	attrGenAIInput     = attribute.Key("gen_ai.usage.input_tokens")
	attrGenAIOutput    = attribute.Key("gen_ai.usage.output_tokens")

	attrOutcome       = attribute.Key("faregate.outcome")
	attrEstimated     = attribute.Key("faregate.usage.estimated")
	attrReserved      = attribute.Key("faregate.reserved_tokens")
	attrWaitedMS      = attribute.Key("faregate.waited_ms")
	attrCharged       = attribute.Key("faregate.charged_tokens")
	attrCostMicro     = attribute.Key("faregate.cost_micro")
	attrOverTokens    = attribute.Key("faregate.overage_tokens")
	attrOverCostMicro = attribute.Key("faregate.overage_cost_micro")
	attrLate          = attribute.Key("faregate.settle.late")
)

// startModel starts the model.call span of an attempt on model, which
// holds a reservation of reserved tokens.
func (g *Governor) startModel(ctx context.Context, kind, model string, reserved int64) (context.Context, modelSpan) {
	if g.d.Tracer == nil {
		return ctx, modelSpan{}
	}
	if kind == "" {
		kind = "chat"
	}
	ctx, span := g.d.Tracer.Start(ctx, spanModel, oteltrace.WithSpanKind(oteltrace.SpanKindClient),
		oteltrace.WithAttributes(attrGenAIOperation.String(kind), attrGenAIModel.String(model), attrReserved.Int64(reserved)))
	return ctx, modelSpan{span}
}

// modelSpan is the model.call span of one attempt on one model: from the
// provider call to its settle, which is its child.
type modelSpan struct{ span oteltrace.Span }

// end records what the attempt used (the provider's report, or the
// estimate it was settled with) and how it ended.
func (m modelSpan) end(outcome string, prompt, completion int64, estimated bool, waited int64) {
	if m.span == nil {
		return
	}
	m.span.SetAttributes(attrGenAIInput.Int64(prompt), attrGenAIOutput.Int64(completion),
		attrEstimated.Bool(estimated), attrOutcome.String(outcome), attrWaitedMS.Int64(waited))
	if outcome == "error" {
		m.span.SetStatus(codes.Error, outcome)
	}
	m.span.End()
}

// startSettle starts the budget.settle span of reservation res; end
// records what the settle charged, or that it failed.
func (g *Governor) startSettle(ctx context.Context, res budget.Reservation) (context.Context, func(budget.Settlement, error)) {
	if g.d.Tracer == nil {
		return ctx, func(budget.Settlement, error) {}
	}
	ctx, span := g.d.Tracer.Start(ctx, spanSettle, oteltrace.WithAttributes(attrGenAIModel.String(res.Model), attrReserved.Int64(res.Tokens)))
	return ctx, func(s budget.Settlement, err error) {
		if err != nil {
			// The budget's error names Redis at most; the code says enough.
			span.SetStatus(codes.Error, "settle failed")
		}
		span.SetAttributes(attrCharged.Int64(s.Tokens), attrCostMicro.Int64(s.CostMicro),
			attrOverTokens.Int64(s.OverageTokens), attrOverCostMicro.Int64(s.OverageCostMicro), attrLate.Bool(s.Late))
		span.End()
	}
}
