package main

import (
	"bufio"
	"compress/gzip"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"

	"faregate/agent/offline"
	"faregate/protect/kit/testkit/clocktest"
)

// startTraced is startServer with the spans going to tp, handed to run
// through its context as only tests do.
func startTraced(t *testing.T, tp trace.TracerProvider, env map[string]string) *server {
	t.Helper()
	return startServerCtx(t, context.WithValue(context.Background(), tracerProviderKey{}, tp), env)
}

// TestTracingSpanTree admits one task on the offline planner with spans
// going to an in-memory exporter, and checks seed 003's "one trace id
// through the gate, the limits, the model call and the billing event":
// the POST's server span with the gate's checks in order, then the run, on
// the far side of the queue, in the same trace with its model calls, tool
// calls and settles; the log lines of both halves carry that trace id; and
// no attribute holds an address or a visitor's whole hash.
func TestTracingSpanTree(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	// The tools answer 404 at once: the run goes on without them, and no
	// test reaches outside the machine.
	tools := httptest.NewServer(http.NotFoundHandler())
	t.Cleanup(tools.Close)
	s := startTraced(t, tp, map[string]string{"FAREGATE_WEATHER_URL": tools.URL, "FAREGATE_GEOCODING_URL": tools.URL})

	r := do(t, "POST", s.URL+"/api/tasks", taskBody("Lisbon"), nil)
	if r.Status != http.StatusAccepted {
		t.Fatalf("POST: %d %s", r.Status, r.Raw)
	}
	id, reqID := r.Body["id"].(string), r.Header.Get("X-Request-Id")
	if got := waitTask(t, s.URL, id); got["status"] != "succeeded" {
		t.Fatalf("task: %v", got)
	}

	// Spans are exported when they end, which may be just after the
	// answer or the final save the client saw.
	var spans tracetest.SpanStubs
	var post, run tracetest.SpanStub
	if !clocktest.Poll(10*time.Second, func() bool {
		spans = exp.GetSpans()
		var okPost, okRun bool
		post, okPost = only(t, spans, "POST /api/tasks")
		run, okRun = only(t, spans, "task.run")
		return okPost && okRun
	}) {
		t.Fatalf("spans %v: no POST server span or task.run", names(spans))
	}

	// The request: a server span with the gate's checks as its children.
	traceID := post.SpanContext.TraceID()
	if post.SpanKind != trace.SpanKindServer || post.Parent.IsValid() {
		t.Errorf("POST span: kind %v, parent %v; want a server root", post.SpanKind, post.Parent)
	}
	wantAttrs(t, post, map[string]any{"http.route": "/api/tasks", "http.request.method": "POST",
		"http.response.status_code": int64(202), "faregate.request_id": reqID})
	if p := attr(post, "faregate.principal"); !regexp.MustCompile(`^v:[0-9a-f]{12}$`).MatchString(p.String()) {
		t.Errorf("faregate.principal %q, want v: and 12 hex", p.String())
	}
	gate := children(spans, post)
	wantGate := []string{"gate.window", "gate.turnstile", "gate.quota_check", "gate.budget", "gate.quota_take", "gate.submit"}
	if got := names(gate); !slices.Equal(got, wantGate) {
		t.Errorf("gate spans %v, want %v in this order", got, wantGate)
	}

	// The run: across the queue, a child of the span that queued it.
	if run.SpanContext.TraceID() != traceID {
		t.Fatalf("task.run in trace %s, the POST in %s", run.SpanContext.TraceID(), traceID)
	}
	if submit, ok := only(t, gate, "gate.submit"); !ok || run.Parent.SpanID() != submit.SpanContext.SpanID() {
		t.Errorf("task.run's parent %s is not gate.submit", run.Parent.SpanID())
	}
	wantAttrs(t, run, map[string]any{"faregate.task_id": id, "faregate.request_id": reqID, "faregate.task.status": "succeeded"})
	steps := children(spans, run)
	var models, toolCalls int
	for _, sp := range steps {
		switch sp.Name {
		case "model.call":
			models++
			wantAttrs(t, sp, map[string]any{"gen_ai.request.model": offline.ModelName, "faregate.outcome": "ok"})
			for _, k := range []string{"gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens", "faregate.reserved_tokens"} {
				if v := attr(sp, k); v.AsInt64() <= 0 {
					t.Errorf("model.call %s = %v, want > 0", k, v.String())
				}
			}
			if attr(sp, "faregate.usage.estimated").Type() != attribute.BOOL {
				t.Error("model.call without faregate.usage.estimated")
			}
			settles := children(spans, sp)
			if len(settles) != 1 || settles[0].Name != "budget.settle" || attr(settles[0], "faregate.charged_tokens").AsInt64() <= 0 {
				t.Errorf("model.call children %v, want one budget.settle that charged tokens", names(settles))
			}
		case "tool.call":
			toolCalls++
			if name := attr(sp, "gen_ai.tool.name").String(); name != "guide_search" && name != "weather" {
				t.Errorf("tool.call gen_ai.tool.name %q", name)
			}
			if attr(sp, "faregate.outcome").String() == "" {
				t.Error("tool.call without faregate.outcome")
			}
		}
	}
	t.Logf("trace %s: %s %v; task.run %v", traceID, post.Name, names(gate), names(steps))
	if models < 2 || toolCalls < 1 {
		t.Errorf("task.run children %v: want the tool-calling and the closing model.call, and tool.calls", names(steps))
	}

	// Nothing anywhere names the visitor: not its address, not its hash.
	ip := regexp.MustCompile(`\b\d{1,3}(\.\d{1,3}){3}\b|::1|\[::`)
	hash := regexp.MustCompile(`[0-9a-f]{64}`)
	for _, sp := range spans {
		for _, kv := range sp.Attributes {
			if v := kv.Value.String(); ip.MatchString(v) || hash.MatchString(v) {
				t.Errorf("span %s attribute %s = %q names the visitor", sp.Name, kv.Key, v)
			}
		}
	}

	// The admission's access line and the run's lines carry the trace id.
	for _, want := range []struct{ msg, key, val string }{
		{"task admitted", "request_id", reqID},
		{"task succeeded", "task", id},
	} {
		line := waitLogLine(t, s, want.msg, want.key, want.val)
		if line["trace_id"] != traceID.String() {
			t.Errorf("%q line: trace_id %v, want %s", want.msg, line["trace_id"], traceID)
		}
	}
}

// TestTracingOffByDefault: without an OTLP endpoint the provider is the
// no-op one and the app gets no tracer at all, so requests and runs start
// no spans (their log lines carry no trace id); the standard switches turn
// it off too, and a protocol the binary cannot speak is refused.
func TestTracingOffByDefault(t *testing.T) {
	ctx := context.Background()
	for _, env := range []map[string]string{
		{},
		{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_SDK_DISABLED": "true"},
		{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:1/v1/traces", "OTEL_TRACES_EXPORTER": "none"},
	} {
		tp, shutdown, err := setupTracing(ctx, envOf(env))
		if err != nil {
			t.Fatalf("%v: %v", env, err)
		}
		if tracerFor(tp, "faregate/api") != nil {
			t.Errorf("%v: tracing is on", env)
		}
		if err := shutdown(ctx); err != nil {
			t.Errorf("%v: shutdown: %v", env, err)
		}
	}
	for _, env := range []map[string]string{
		{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
		{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_TRACES_EXPORTER": "zipkin"},
	} {
		if _, _, err := setupTracing(ctx, envOf(env)); err == nil {
			t.Errorf("%v: accepted", env)
		}
	}

	tools := httptest.NewServer(http.NotFoundHandler())
	t.Cleanup(tools.Close)
	s := startServer(t, map[string]string{"FAREGATE_WEATHER_URL": tools.URL, "FAREGATE_GEOCODING_URL": tools.URL})
	r := do(t, "POST", s.URL+"/api/tasks", taskBody("Porto"), map[string]string{
		"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
	if r.Status != http.StatusAccepted {
		t.Fatalf("POST: %d %s", r.Status, r.Raw)
	}
	id := r.Body["id"].(string)
	waitTask(t, s.URL, id)
	for _, want := range []struct{ msg, key, val string }{
		{"task admitted", "request_id", r.Header.Get("X-Request-Id")},
		{"task succeeded", "task", id},
	} {
		if line := waitLogLine(t, s, want.msg, want.key, want.val); line["trace_id"] != nil {
			t.Errorf("%q line has trace_id %v with tracing off", want.msg, line["trace_id"])
		}
	}
}

// TestTracingExportsOverOTLP: with OTEL_EXPORTER_OTLP_ENDPOINT set, spans
// reach that endpoint over OTLP/HTTP by the time shutdown returns, under
// the service name faregate, or OTEL_SERVICE_NAME's.
func TestTracingExportsOverOTLP(t *testing.T) {
	for _, tc := range []struct{ name, serviceEnv, want string }{
		{"default name", "", "faregate"},
		{"OTEL_SERVICE_NAME", "faregate-eu", "faregate-eu"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := make(chan *collectortrace.ExportTraceServiceRequest, 4)
			collector := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				var body io.Reader = r.Body
				if r.Header.Get("Content-Encoding") == "gzip" {
					zr, err := gzip.NewReader(r.Body)
					if err != nil {
						w.WriteHeader(http.StatusBadRequest)
						return
					}
					body = zr
				}
				raw, _ := io.ReadAll(body)
				var req collectortrace.ExportTraceServiceRequest
				if r.URL.Path != "/v1/traces" || proto.Unmarshal(raw, &req) != nil {
					w.WriteHeader(http.StatusBadRequest)
					return
				}
				got <- &req
				w.Header().Set("Content-Type", "application/x-protobuf")
				out, _ := proto.Marshal(&collectortrace.ExportTraceServiceResponse{})
				_, _ = w.Write(out)
			}))
			t.Cleanup(collector.Close)
			// The exporter and the resource read the process environment
			// themselves, as they do in the binary.
			t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.URL)
			t.Setenv("OTEL_SERVICE_NAME", tc.serviceEnv)

			ctx := context.Background()
			tp, shutdown, err := setupTracing(ctx, os.Getenv)
			if err != nil {
				t.Fatal(err)
			}
			tr := tracerFor(tp, "faregate/api")
			if tr == nil {
				t.Fatal("tracing off with an endpoint set")
			}
			_, span := tr.Start(ctx, "gate.window")
			span.End()
			if err := shutdown(ctx); err != nil {
				t.Fatalf("shutdown: %v", err)
			}
			var req *collectortrace.ExportTraceServiceRequest
			select {
			case req = <-got:
			default:
				t.Fatal("the collector received nothing by the end of shutdown")
			}
			rs := req.GetResourceSpans()
			if len(rs) != 1 || len(rs[0].GetScopeSpans()) != 1 || len(rs[0].GetScopeSpans()[0].GetSpans()) != 1 {
				t.Fatalf("export %v", req)
			}
			if name := rs[0].GetScopeSpans()[0].GetSpans()[0].GetName(); name != "gate.window" {
				t.Errorf("span %q", name)
			}
			res := map[string]string{}
			for _, kv := range rs[0].GetResource().GetAttributes() {
				res[kv.GetKey()] = kv.GetValue().GetStringValue()
			}
			if res["service.name"] != tc.want || res["service.version"] == "" {
				t.Errorf("resource %v, want service.name %q and a service.version", res, tc.want)
			}
		})
	}
}

// only returns the one span named name (false when there is none yet);
// more than one fails the test.
func only(t *testing.T, spans tracetest.SpanStubs, name string) (tracetest.SpanStub, bool) {
	t.Helper()
	var found []tracetest.SpanStub
	for _, s := range spans {
		if s.Name == name {
			found = append(found, s)
		}
	}
	if len(found) > 1 {
		t.Fatalf("%d spans named %s", len(found), name)
	}
	if len(found) == 0 {
		return tracetest.SpanStub{}, false
	}
	return found[0], true
}

// children are parent's child spans in the order they started.
func children(spans tracetest.SpanStubs, parent tracetest.SpanStub) tracetest.SpanStubs {
	var out tracetest.SpanStubs
	for _, s := range spans {
		if s.Parent.SpanID() == parent.SpanContext.SpanID() && s.SpanContext.TraceID() == parent.SpanContext.TraceID() {
			out = append(out, s)
		}
	}
	slices.SortStableFunc(out, func(a, b tracetest.SpanStub) int { return a.StartTime.Compare(b.StartTime) })
	return out
}

func names(spans tracetest.SpanStubs) []string {
	out := make([]string, len(spans))
	for i, s := range spans {
		out[i] = s.Name
	}
	return out
}

// attr is the value of a span's attribute (the zero Value when absent).
func attr(s tracetest.SpanStub, key string) attribute.Value {
	for _, kv := range s.Attributes {
		if string(kv.Key) == key {
			return kv.Value
		}
	}
	return attribute.Value{}
}

func wantAttrs(t *testing.T, s tracetest.SpanStub, want map[string]any) {
	t.Helper()
	for k, v := range want {
		if got := attr(s, k).AsInterface(); got != v {
			t.Errorf("%s: %s = %v (%T), want %v", s.Name, k, got, got, v)
		}
	}
}

// waitLogLine returns the first JSON log line with message msg whose key
// is val, waiting a little: the access line is written after the answer.
func waitLogLine(t *testing.T, s *server, msg, key, val string) map[string]any {
	t.Helper()
	var found map[string]any
	if !clocktest.Poll(5*time.Second, func() bool {
		sc := bufio.NewScanner(strings.NewReader(s.Out.String()))
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			var line map[string]any
			if json.Unmarshal(sc.Bytes(), &line) == nil && line["msg"] == msg && line[key] == val {
				found = line
				return true
			}
		}
		return false
	}) {
		t.Fatalf("no %q log line with %s=%s:\n%s", msg, key, val, s.Out.String())
	}
	return found
}
