package outboxcli

import (
	"context"
	"os"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/tracing"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store/admin"
	"github.com/outboxhq/outbox/store/table"
)

// Background work of `outbox relay`: retention on a schedule and the
// tracing wrapper around the broker's publisher.

func init() {
	relayHooks = append(relayHooks, startRetention)
	publisherWraps = append(publisherWraps, wrapCloudEvents, wrapTracing)
}

// wrapCloudEvents adds the CloudEvents attributes, in the broker's binding,
// when cloudevents.enabled is set.
func wrapCloudEvents(_ context.Context, e *app, pub core.Publisher) (core.Publisher, error) {
	if !e.cfg.CloudEvents.Enabled {
		return pub, nil
	}
	return brokers.WithCloudEvents(pub, brokers.CloudEvents{Source: e.cfg.CloudEvents.Source}, brokers.CloudEventsBindingFor(e.cfg.Broker))
}

// wrapTracing adds the relay's publish span when tracing.enabled is set.
// With the OTEL_EXPORTER_OTLP_* variables naming a collector, spans go to
// a tracer provider of the relay's own, exporting over OTLP and flushed
// when the relay stops; otherwise to the global OpenTelemetry provider,
// which a binary built on Main may set (otel.SetTracerProvider). Without
// either, the stored trace context is still forwarded as traceparent.
func wrapTracing(ctx context.Context, e *app, pub core.Publisher) (core.Publisher, error) {
	environ := os.Environ()
	if !e.cfg.Tracing.Enabled {
		if otlpEnabled(environ) {
			e.log.Warn("OTLP export is configured but tracing.enabled is false: the relay makes no spans")
		}
		return pub, nil
	}
	var provider trace.TracerProvider = otel.GetTracerProvider()
	tp, protocol, err := newOTLPProvider(ctx, environ)
	if err != nil {
		return nil, err
	}
	if tp != nil {
		provider = tp
		e.onStop(func(ctx context.Context) {
			if err := shutdownTracing(ctx, tp); err != nil {
				e.log.Warn("tracing: spans lost at exit", "error", e.mask.error(err))
			}
		})
		e.log.Info("tracing: exporting spans over OTLP", "protocol", protocol)
	}
	// The global propagator is a no-op until a program sets one, and the
	// producer's writer stores W3C trace context.
	prop := otel.GetTextMapPropagator()
	if len(prop.Fields()) == 0 {
		prop = propagation.TraceContext{}
	}
	return tracing.Wrap(pub, tracing.Options{
		TracerProvider: provider,
		Propagator:     prop,
		System:         e.cfg.Broker,
		Destination:    topicLabel(&e.cfg.Routing),
	})
}

func startRetention(ctx context.Context, e *app, st *table.Source, _ core.Publisher, _ func() *core.Relay) (core.Observer, error) {
	rt := e.cfg.Retention
	if !rt.Enabled {
		return nil, nil
	}
	opts := admin.CleanupOptions{Dispatched: rt.Dispatched, Processed: rt.Processed, BatchSize: rt.BatchSize}
	ad, err := admin.New(st.Pool(), st.Config(), e.log)
	if err != nil {
		return nil, err
	}
	go ad.RunRetention(ctx, opts, rt.Interval)
	return nil, nil
}
