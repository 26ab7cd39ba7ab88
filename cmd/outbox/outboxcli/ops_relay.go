package outboxcli

import (
	"context"

	"go.opentelemetry.io/otel"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/tracing"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store"
)

// Background work of `outbox relay`: retention on a schedule and the
// tracing wrapper around the broker's publisher.

func init() {
	relayHooks = append(relayHooks, startRetention)
	publisherWraps = append(publisherWraps, wrapCloudEvents, wrapTracing)
}

// wrapCloudEvents adds the CloudEvents attributes, in the broker's binding,
// when cloudevents.enabled is set.
func wrapCloudEvents(e *env, pub core.Publisher) (core.Publisher, error) {
	if !e.cfg.CloudEvents.Enabled {
		return pub, nil
	}
	return brokers.WithCloudEvents(pub, brokers.CloudEvents{Source: e.cfg.CloudEvents.Source}, brokers.CloudEventsBindingFor(e.cfg.Broker))
}

// wrapTracing adds the relay's publish span when tracing.enabled is set.
// Spans go to the global OpenTelemetry provider: a binary built on Main
// sets it (otel.SetTracerProvider) with the exporter it wants; without one
// the stored trace context is still forwarded as traceparent.
func wrapTracing(e *env, pub core.Publisher) (core.Publisher, error) {
	if !e.cfg.Tracing.Enabled {
		return pub, nil
	}
	return tracing.Wrap(pub, tracing.Options{
		TracerProvider: otel.GetTracerProvider(),
		Propagator:     otel.GetTextMapPropagator(),
		System:         e.cfg.Broker,
		Destination:    topicLabel(&e.cfg.Routing),
	})
}

func startRetention(ctx context.Context, e *env, st *store.Store, _ core.Publisher, _ func() *core.Relay) (core.Observer, error) {
	rt := e.cfg.Retention
	if !rt.Enabled {
		return nil, nil
	}
	opts := store.CleanupOptions{Dispatched: rt.Dispatched, Processed: rt.Processed, BatchSize: rt.BatchSize}
	go st.RunRetention(ctx, opts, rt.Interval)
	return nil, nil
}
