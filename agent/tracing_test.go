package agent

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"faregate/agent/chat"
	"faregate/agent/govern"
	"faregate/agent/task"
	"faregate/protect/breaker"
)

// tracedRun runs the rig's workflow with spans going to an in-memory
// exporter, under a parent span as the runner's task.run would be, and
// returns the parent and every span.
func tracedRun(t *testing.T, r *rig) (tracetest.SpanStub, tracetest.SpanStubs) {
	t.Helper()
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	d := r.deps()
	d.Tracer = tp.Tracer("test")
	ctx, parent := tp.Tracer("test").Start(context.Background(), spanRun)
	err := NewWorkflow(r.cfg, d).Run(ctx, record(lisbon), func(*task.Record, ...task.Event) error { return nil })
	parent.End()
	if err != nil {
		t.Fatal(err)
	}
	spans := exp.GetSpans()
	return spans[len(spans)-1], spans
}

// childrenOf are the spans whose parent is p, in the order they started.
func childrenOf(spans tracetest.SpanStubs, p tracetest.SpanStub) tracetest.SpanStubs {
	var out tracetest.SpanStubs
	for _, s := range spans {
		if s.Parent.SpanID() == p.SpanContext.SpanID() {
			out = append(out, s)
		}
	}
	slices.SortStableFunc(out, func(a, b tracetest.SpanStub) int { return a.StartTime.Compare(b.StartTime) })
	return out
}

func attrOf(s tracetest.SpanStub, key string) attribute.Value {
	for _, kv := range s.Attributes {
		if string(kv.Key) == key {
			return kv.Value
		}
	}
	return attribute.Value{}
}

// TestTracingToolAndModelSpans: each model call and each tool call the model
// asked for is a child of the run's span; a tool answered from the task's
// memory says so, and a tool name the model made up is not recorded; each
// model call's settle is its child and says what it charged.
func TestTracingToolAndModelSpans(t *testing.T) {
	m := &fakeModel{GenerateFn: func(_ context.Context, n int, _ chat.Turn) (chat.Reply, error) {
		if n == 1 {
			return calls("guide_search", `{"query":"Lisbon"}`, "teleport_to_<script>", `{}`, "guide_search", `{"query":"lisbon"}`), nil
		}
		return plan(2), nil
	}}
	r := newRig(m, newTool("guide_search"))
	parent, spans := tracedRun(t, r)

	var got []string
	for _, s := range childrenOf(spans, parent) {
		switch s.Name {
		case spanModel:
			got = append(got, s.Name+":"+attrOf(s, "faregate.outcome").String())
			if attrOf(s, "gen_ai.request.model").String() != "primary" || !attrOf(s, "faregate.usage.estimated").AsBool() ||
				attrOf(s, "gen_ai.usage.input_tokens").AsInt64() <= 0 {
				t.Errorf("model.call attributes %v", s.Attributes)
			}
			settles := childrenOf(spans, s)
			if len(settles) != 1 || settles[0].Name != spanSettle || attrOf(settles[0], "faregate.charged_tokens").AsInt64() <= 0 {
				t.Errorf("model.call children %v", settles)
			}
		case spanTool:
			got = append(got, s.Name+":"+attrOf(s, "gen_ai.tool.name").String()+":"+attrOf(s, "faregate.outcome").String())
			if cached := attrOf(s, "faregate.tool.cached").AsBool(); cached != (attrOf(s, "faregate.outcome").String() == "cached") {
				t.Errorf("tool.call cached=%v with outcome %s", cached, attrOf(s, "faregate.outcome").String())
			}
		default:
			got = append(got, s.Name)
		}
	}
	want := []string{"model.call:ok", "tool.call:guide_search:ok", "tool.call:unknown:failed", "tool.call:guide_search:cached", "model.call:ok"}
	if !slices.Equal(got, want) {
		t.Fatalf("run's children\n%v\nwant\n%v", got, want)
	}
}

// TestTracingFallbackSpans: a failed attempt on the primary and the fallback's
// answer are two model.call spans, the first marked an error, each with
// its own settle.
func TestTracingFallbackSpans(t *testing.T) {
	primary := &fakeModel{GenerateFn: func(context.Context, int, chat.Turn) (chat.Reply, error) {
		return chat.Reply{}, errors.New("503 from provider")
	}}
	cheap := &fakeModel{GenerateFn: func(context.Context, int, chat.Turn) (chat.Reply, error) { return plan(2), nil }}
	r := newRig(primary)
	r.models.Fallback = &govern.Model{Model: cheap, Name: "cheap"}
	r.models.Breaker = breaker.New(breaker.Settings{OpenFor: time.Hour}, nil, nil)
	parent, spans := tracedRun(t, r)

	calls := childrenOf(spans, parent)
	if len(calls) != 2 {
		t.Fatalf("run's children %d, want 2 model calls", len(calls))
	}
	first, second := calls[0], calls[1]
	if attrOf(first, "gen_ai.request.model").String() != "primary" || attrOf(first, "faregate.outcome").String() != "error" || first.Status.Code != codes.Error {
		t.Errorf("failed attempt: %v status %v", first.Attributes, first.Status)
	}
	if attrOf(second, "gen_ai.request.model").String() != "cheap" || attrOf(second, "faregate.outcome").String() != "ok" || second.Status.Code == codes.Error {
		t.Errorf("fallback attempt: %v status %v", second.Attributes, second.Status)
	}
	for _, c := range calls {
		if s := childrenOf(spans, c); len(s) != 1 || s[0].Name != spanSettle {
			t.Errorf("%s children %v, want its settle", attrOf(c, "gen_ai.request.model").String(), s)
		}
	}
}
