package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// tracerProviderKey carries a TracerProvider in the context run is given.
// Only tests set it (an in-memory exporter), so that two servers in one
// test process never share a global provider.
type tracerProviderKey struct{}

// setupTracing returns the provider the app's spans go to, and the
// shutdown that flushes it. Tracing is on only when
// OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set:
// spans then go in batches to that endpoint over OTLP/HTTP. The exporter
// reads the other standard variables itself (headers, timeout,
// compression, certificates), the SDK the sampler (OTEL_TRACES_SAMPLER)
// and the batch sizes (OTEL_BSP_*), the resource OTEL_SERVICE_NAME and
// OTEL_RESOURCE_ATTRIBUTES; in the binary getenv is the process's own
// environment, so they all agree. Otherwise, and with OTEL_SDK_DISABLED=true
// or OTEL_TRACES_EXPORTER=none, it is the no-op provider, and tracerFor
// hands the app no tracer at all.
func setupTracing(ctx context.Context, getenv func(string) string) (trace.TracerProvider, func(context.Context) error, error) {
	if tp, ok := ctx.Value(tracerProviderKey{}).(trace.TracerProvider); ok {
		return tp, noShutdown, nil // the test owns it and reads its spans
	}
	off := noop.NewTracerProvider()
	if getenv("OTEL_EXPORTER_OTLP_ENDPOINT") == "" && getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") == "" ||
		strings.EqualFold(strings.TrimSpace(getenv("OTEL_SDK_DISABLED")), "true") {
		return off, noShutdown, nil
	}
	switch exp := getenv("OTEL_TRACES_EXPORTER"); exp {
	case "", "otlp":
	case "none":
		return off, noShutdown, nil
	default:
		return nil, nil, fmt.Errorf("OTEL_TRACES_EXPORTER=%q: faregate exports traces over OTLP only (otlp or none)", exp)
	}
	protocol := getenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
	if protocol == "" {
		protocol = getenv("OTEL_EXPORTER_OTLP_PROTOCOL")
	}
	if protocol != "" && protocol != "http/protobuf" {
		// Only the HTTP exporter is linked in; sending HTTP to a gRPC port
		// would fail on every export, silently but for the error log.
		return nil, nil, fmt.Errorf("OTEL_EXPORTER_OTLP_PROTOCOL=%q: faregate exports traces over OTLP/HTTP only (http/protobuf)", protocol)
	}
	exp, err := otlptracehttp.New(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("tracing: OTLP exporter: %w", err)
	}
	// The defaults come first so that OTEL_SERVICE_NAME and
	// OTEL_RESOURCE_ATTRIBUTES (read by WithFromEnv) override them.
	res, err := resource.New(ctx,
		resource.WithAttributes(semconv.ServiceName("faregate"), semconv.ServiceVersion(versionString())),
		resource.WithFromEnv(), resource.WithTelemetrySDK())
	if err != nil {
		_ = exp.Shutdown(ctx)
		return nil, nil, fmt.Errorf("tracing: resource (OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME): %w", err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	return tp, tp.Shutdown, nil
}

func noShutdown(context.Context) error { return nil }

// tracerFor is tp's tracer for one package, or nil while tracing is off:
// the packages then skip their spans entirely instead of starting no-op
// ones on every request.
func tracerFor(tp trace.TracerProvider, name string) trace.Tracer {
	if _, off := tp.(noop.TracerProvider); off || tp == nil {
		return nil
	}
	return tp.Tracer(name, trace.WithInstrumentationVersion(versionString()))
}

// stopTracing flushes the spans still batched, within a few seconds: an
// unreachable collector must not hold up the exit.
func stopTracing(shutdown func(context.Context) error, lg *slog.Logger) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := shutdown(ctx); err != nil && !errors.Is(err, context.Canceled) {
		lg.Warn("tracing: spans not flushed at exit", "err", redactURL(err.Error()))
	}
}

// otelErrorsOnce installs the OpenTelemetry error handler once per
// process: like go-redis's logger, it is the library's own global.
var otelErrorsOnce sync.Once

// quietTracingErrors routes the SDK's errors (a collector that is down
// fails every export) through slog, at most one line per 10 s, instead of
// the standard logger on stderr.
func quietTracingErrors(lg *slog.Logger) {
	otelErrorsOnce.Do(func() {
		l := &limitedLog{lg: lg, every: 10 * time.Second}
		otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) { l.write("tracing: " + err.Error()) }))
	})
}
