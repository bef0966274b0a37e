package tracing

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"regexp"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

func recorder(t *testing.T) (*tracetest.InMemoryExporter, trace.Tracer) {
	t.Helper()
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return exp, tp.Tracer("test")
}

// TestStartOff: with tracing off (a nil tracer) a span costs nothing: the
// context comes back as it was, nothing records, nothing is allocated.
func TestStartOff(t *testing.T) {
	type key struct{}
	ctx := context.WithValue(context.Background(), key{}, 1)
	got, span := Start(ctx, nil, "x")
	if got != ctx {
		t.Fatal("Start with a nil tracer changed the context")
	}
	if span.IsRecording() || span.SpanContext().IsValid() {
		t.Fatal("Start with a nil tracer returned a live span")
	}
	if TraceParent(got) != "" || LogAttrs(got) != nil {
		t.Fatal("a context without a span has a traceparent or trace log attributes")
	}
	allocs := testing.AllocsPerRun(100, func() {
		c, s := Start(ctx, nil, "x")
		s.End()
		_ = LogAttrs(c)
	})
	if allocs != 0 {
		t.Fatalf("off path allocates %.0f times per span, want 0", allocs)
	}
}

// TestTraceParentCrossesAQueue: a traceparent written where a task is
// queued starts, where it runs, a child in the same trace.
func TestTraceParentCrossesAQueue(t *testing.T) {
	exp, tr := recorder(t)
	ctx, submit := tr.Start(context.Background(), "gate.submit")
	tp := TraceParent(ctx)
	submit.End()
	if !regexp.MustCompile(`^00-[0-9a-f]{32}-[0-9a-f]{16}-01$`).MatchString(tp) {
		t.Fatalf("traceparent %q", tp)
	}

	_, run := tr.Start(WithTraceParent(context.Background(), tp), "task.run")
	run.End()
	spans := exp.GetSpans()
	if len(spans) != 2 {
		t.Fatalf("%d spans", len(spans))
	}
	parent, child := spans[0], spans[1]
	if child.SpanContext.TraceID() != parent.SpanContext.TraceID() || child.Parent.SpanID() != parent.SpanContext.SpanID() {
		t.Fatalf("run not a child of submit: %v / %v", child.Parent, parent.SpanContext)
	}
	if !child.Parent.IsRemote() {
		t.Fatal("the queued parent is not marked remote")
	}

	for _, bad := range []string{"", "garbage", "00-00000000000000000000000000000000-0000000000000000-01"} {
		if trace.SpanContextFromContext(WithTraceParent(context.Background(), bad)).IsValid() {
			t.Errorf("traceparent %q gave a valid parent", bad)
		}
	}
}

// TestFromHeader reads an incoming request's traceparent header.
func TestFromHeader(t *testing.T) {
	h := http.Header{}
	h.Set("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	sc := trace.SpanContextFromContext(FromHeader(context.Background(), h))
	if sc.TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" || !sc.IsRemote() {
		t.Fatalf("span context %v", sc)
	}
	if trace.SpanContextFromContext(FromHeader(context.Background(), http.Header{})).IsValid() {
		t.Fatal("no header gave a parent")
	}
}

// TestLogger: log lines of a traced run carry its trace and span ids; an
// untraced run's logger is the one it was given.
func TestLogger(t *testing.T) {
	_, tr := recorder(t)
	var buf bytes.Buffer
	lg := slog.New(slog.NewJSONHandler(&buf, nil))
	if Logger(context.Background(), lg) != lg {
		t.Fatal("Logger without a span made a new logger")
	}
	ctx, span := tr.Start(context.Background(), "task.run")
	defer span.End()
	Logger(ctx, lg).Info("task succeeded")
	var line map[string]any
	if err := json.Unmarshal(buf.Bytes(), &line); err != nil {
		t.Fatal(err)
	}
	sc := span.SpanContext()
	if line["trace_id"] != sc.TraceID().String() || line["span_id"] != sc.SpanID().String() {
		t.Fatalf("line %v, want trace %s span %s", line, sc.TraceID(), sc.SpanID())
	}
}
