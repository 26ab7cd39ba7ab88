package outboxcli

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel"

	"github.com/outboxhq/outbox/brokers/tracing"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store"
)

// Background work of `outbox relay`: retention on a schedule and the
// tracing wrapper around the broker's publisher.

func init() {
	relayHooks = append(relayHooks, startRetention)
	publisherWraps = append(publisherWraps, wrapTracing)
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
	go runRetention(ctx, st, opts, rt.Interval, e.log.With("task", "retention"))
	return nil, nil
}

// runRetention cleans up every interval, the first time one minute after
// start (or sooner with a shorter interval), until ctx is done. Every
// replica runs it; the store's advisory lock lets one clean at a time.
func runRetention(ctx context.Context, st *store.Store, opts store.CleanupOptions, interval time.Duration, log *slog.Logger) {
	t := time.NewTimer(min(interval, time.Minute))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		res, err := st.Cleanup(ctx, opts)
		switch {
		case errors.Is(err, store.ErrCleanupBusy):
			log.Debug("retention skipped: another replica is cleaning up")
		case err != nil && ctx.Err() == nil:
			log.Error("retention failed", "error", err, "outbox_deleted", res.Outbox, "processed_deleted", res.Processed)
		}
		t.Reset(interval)
	}
}
