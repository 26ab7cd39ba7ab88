package outboxcli

import (
	"context"
	"fmt"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// OTLP export of the relay's spans, configured the standard way: by the
// OTEL_EXPORTER_OTLP_* variables, which the exporters read themselves
// (endpoint, headers, TLS, timeout, compression), plus OTEL_SERVICE_NAME,
// OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER and OTEL_BSP_*, which the
// SDK reads. The binary adds only the choice of exporter.

// otlpEnabled reports whether environ asks for OTLP export of traces: an
// endpoint is named, or OTEL_TRACES_EXPORTER is otlp; "none" and
// OTEL_SDK_DISABLED=true turn it off.
func otlpEnabled(environ []string) bool {
	get := envLookup(environ)
	if strings.EqualFold(get("OTEL_SDK_DISABLED"), "true") {
		return false
	}
	switch strings.TrimSpace(get("OTEL_TRACES_EXPORTER")) {
	case "none":
		return false
	case "otlp":
		return true
	}
	return get("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != ""
}

// otlpProtocol is the trace exporter's protocol, from
// OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or OTEL_EXPORTER_OTLP_PROTOCOL;
// http/protobuf when neither is set, as the specification says.
func otlpProtocol(environ []string) (string, error) {
	get := envLookup(environ)
	name, p := "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
	if p == "" {
		name, p = "OTEL_EXPORTER_OTLP_PROTOCOL", get("OTEL_EXPORTER_OTLP_PROTOCOL")
	}
	switch p {
	case "", "http/protobuf":
		return "http/protobuf", nil
	case "grpc":
		return "grpc", nil
	}
	return "", usagef("%s: %q is not supported (use grpc or http/protobuf)", name, p)
}

// OTEL_EXPORTER_OTLP_TRACES_EXPORTER values other than otlp and none
// would name exporters this binary does not have.
func checkTracesExporter(environ []string) error {
	switch v := strings.TrimSpace(envLookup(environ)("OTEL_TRACES_EXPORTER")); v {
	case "", "otlp", "none":
		return nil
	default:
		return usagef("OTEL_TRACES_EXPORTER: %q is not supported by this binary (use otlp or none)", v)
	}
}

func envLookup(environ []string) func(string) string {
	return func(name string) string {
		for i := len(environ) - 1; i >= 0; i-- {
			if k, v, ok := strings.Cut(environ[i], "="); ok && k == name {
				return v
			}
		}
		return ""
	}
}

// newOTLPProvider returns a tracer provider exporting over OTLP as
// environ says, or nil when it asks for no export. shutdown flushes the
// spans still buffered; call it once the relay has stopped.
func newOTLPProvider(ctx context.Context, environ []string) (tp *sdktrace.TracerProvider, protocol string, err error) {
	if err := checkTracesExporter(environ); err != nil {
		return nil, "", err
	}
	if !otlpEnabled(environ) {
		return nil, "", nil
	}
	protocol, err = otlpProtocol(environ)
	if err != nil {
		return nil, "", err
	}
	var exp sdktrace.SpanExporter
	// The exporters read the process environment; environ is that in the
	// binary, and tests set the same variables with t.Setenv.
	if protocol == "grpc" {
		exp, err = otlptracegrpc.New(ctx)
	} else {
		exp, err = otlptracehttp.New(ctx)
	}
	if err != nil {
		return nil, "", usagef("OTLP trace exporter (%s): %w", protocol, err)
	}
	res, err := resource.New(ctx,
		resource.WithAttributes(attribute.String("service.name", "outbox-relay")),
		resource.WithFromEnv(), // OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win
		resource.WithTelemetrySDK(),
		resource.WithHost(),
		resource.WithProcessPID(),
	)
	if err != nil {
		_ = exp.Shutdown(ctx)
		return nil, "", usagef("OTLP trace resource: %w", err)
	}
	return sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res)), protocol, nil
}

// shutdownTracing flushes and stops tp, bounded so a collector that does
// not answer cannot hold up the exit.
func shutdownTracing(ctx context.Context, tp *sdktrace.TracerProvider) error {
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if err := tp.Shutdown(sctx); err != nil {
		return fmt.Errorf("flush OTLP spans: %w", err)
	}
	return nil
}
