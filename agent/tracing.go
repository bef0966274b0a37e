package agent

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	oteltrace "go.opentelemetry.io/otel/trace"

	"faregate/agent/task"
	"faregate/protect/kit/tracing"
	"faregate/protect/principal"
)

// Span names of a task's run: stable, since dashboards and the tracing
// test look for them.
const (
	spanRun    = "task.run"
	spanModel  = "model.call"
	spanTool   = "tool.call"
	spanSettle = "budget.settle"
)

// Span attributes. The model, the operation, the tool and the token counts
// use the names of OpenTelemetry's GenAI conventions (still in
// development, so not in the semconv package this module uses); the rest
// are faregate's own. Values are bounded: ids, codes, tool names and
// principals as alerts show them; never an address or a visitor's whole
// hash.
const (
	attrGenAIOperation = attribute.Key("gen_ai.operation.name")
	attrGenAIModel     = attribute.Key("gen_ai.request.model")
	attrGenAIInput     = attribute.Key("gen_ai.usage.input_tokens")
	attrGenAIOutput    = attribute.Key("gen_ai.usage.output_tokens")
	attrGenAITool      = attribute.Key("gen_ai.tool.name")

	attrTaskID        = attribute.Key("faregate.task_id")
	attrRequestID     = attribute.Key("faregate.request_id")
	attrPrincipal     = attribute.Key("faregate.principal")
	attrTier          = attribute.Key("faregate.tier")
	attrStatus        = attribute.Key("faregate.task.status")
	attrCode          = attribute.Key("faregate.code")
	attrSteps         = attribute.Key("faregate.steps")
	attrOutcome       = attribute.Key("faregate.outcome")
	attrEstimated     = attribute.Key("faregate.usage.estimated")
	attrReserved      = attribute.Key("faregate.reserved_tokens")
	attrWaitedMS      = attribute.Key("faregate.waited_ms")
	attrCached        = attribute.Key("faregate.tool.cached")
	attrCharged       = attribute.Key("faregate.charged_tokens")
	attrCostMicro     = attribute.Key("faregate.cost_micro")
	attrOverTokens    = attribute.Key("faregate.overage_tokens")
	attrOverCostMicro = attribute.Key("faregate.overage_cost_micro")
	attrLate          = attribute.Key("faregate.settle.late")
)

// noEnd ends a span that was never started (tracing off).
func noEnd() {}

// startRun starts a task's task.run span as a child of the span that
// queued it (the traceparent its record carries), so the gate's checks and
// the run's model calls, tool calls and settles share one trace, whichever
// replica took the task. The returned end reads the record as it is then.
func (r *Runner) startRun(ctx context.Context, rec *task.Record) (context.Context, func()) {
	if r.o.Tracer == nil {
		return ctx, noEnd
	}
	ctx, span := r.o.Tracer.Start(tracing.WithTraceParent(ctx, rec.Trace), spanRun,
		oteltrace.WithSpanKind(oteltrace.SpanKindConsumer),
		oteltrace.WithAttributes(attrTaskID.String(rec.ID), attrRequestID.String(rec.RequestID),
			attrPrincipal.String(principal.FromAccount(rec.Principal).String()), attrTier.String(rec.Tier)))
	return ctx, func() {
		span.SetAttributes(attrStatus.String(rec.Status), attrSteps.Int(len(rec.Steps)),
			attrGenAIInput.Int64(rec.Usage.PromptTokens),
			attrGenAIOutput.Int64(rec.Usage.CompletionTokens))
		if rec.Error != nil {
			span.SetAttributes(attrCode.String(rec.Error.Code))
			span.SetStatus(codes.Error, rec.Error.Code)
		}
		span.End()
	}
}

// startTool starts the tool.call span of one tool call the model asked
// for; end records how the call was answered, as its step says: ok,
// failed, or cached (from the task's memory).
func (r *run) startTool(ctx context.Context, name string) (context.Context, func()) {
	if r.w.d.Tracer == nil {
		return ctx, noEnd
	}
	if _, ok := r.tools[name]; !ok {
		name = "unknown" // the model chose this name: not an attribute value
	}
	ctx, span := r.w.d.Tracer.Start(ctx, spanTool, oteltrace.WithAttributes(attrGenAITool.String(name)))
	return ctx, func() {
		status := r.lastStepStatus()
		span.SetAttributes(attrOutcome.String(status), attrCached.Bool(status == "cached"))
		span.End()
	}
}

// lastStepStatus is the status of the run's latest step: every tool call
// records exactly one step before it returns.
func (r *run) lastStepStatus() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.rec.Steps) == 0 {
		return ""
	}
	return r.rec.Steps[len(r.rec.Steps)-1].Status
}
