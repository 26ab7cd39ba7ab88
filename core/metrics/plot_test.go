package metrics_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/metrics"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store/table"
)

// flakyBroker fails every publish while down is set.
type flakyBroker struct{ down atomic.Bool }

func (b *flakyBroker) Publish(context.Context, *core.Event) error {
	if b.down.Load() {
		return errors.New("broker unreachable")
	}
	return nil
}

func (b *flakyBroker) Close() error { return nil }

// TestRecordLagTimeline runs a producer, a relay and the metrics through a
// healthy period, a broker outage and the recovery, and writes the gauges
// as seen on /metrics to $OUTBOX_PLOT_DIR/ops-lag.csv every half second;
// docs/img/ops-lag.gp renders the picture in docs/operations.md.
func TestRecordLagTimeline(t *testing.T) {
	dir := os.Getenv("OUTBOX_PLOT_DIR")
	if dir == "" {
		t.Skip("set OUTBOX_PLOT_DIR to record")
	}
	pool, cfg := pgtest.Schema(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	st, err := table.New(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	obs, err := metrics.NewObserver(metrics.Options{Registerer: reg, Broker: "rabbitmq"})
	if err != nil {
		t.Fatal(err)
	}
	poller, err := metrics.NewPoller(st, metrics.PollerOptions{Registerer: reg, Interval: 250 * time.Millisecond, StuckAfter: 15 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	broker := &flakyBroker{}
	r, err := core.New(st, broker, core.Options{Observer: obs, PollInterval: 100 * time.Millisecond,
		RetryBackoff: core.Backoff{Min: 200 * time.Millisecond, Max: 2 * time.Second},
		ErrorBackoff: core.Backoff{Min: 100 * time.Millisecond, Max: 2 * time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer r.Stop(context.Background())
	pollDone := make(chan struct{})
	go func() { defer close(pollDone); poller.Run(ctx) }()
	defer func() { cancel(); <-pollDone }()

	// The producer: 100 events a second in transactions of 5.
	w, err := outbox.NewWriter(outbox.WriterOptions{Store: cfg})
	if err != nil {
		t.Fatal(err)
	}
	prodDone := make(chan struct{})
	go func() {
		defer close(prodDone)
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			tx, err := pool.Begin(ctx)
			if err != nil {
				return
			}
			msgs := make([]outbox.Message, 5)
			for i := range msgs {
				msgs[i] = outbox.Message{AggregateID: uuid.NewString(), Type: "order.placed", Payload: map[string]int{"n": i}}
			}
			if err := w.Write(ctx, tx, msgs...); err != nil {
				_ = tx.Rollback(ctx)
				return
			}
			_ = tx.Commit(ctx)
		}
	}()
	defer func() { cancel(); <-prodDone }()

	f, err := os.Create(filepath.Join(dir, "ops-lag.csv"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fmt.Fprintln(f, "seconds,pending,oldest_pending_age_seconds,stuck,published_per_second,publish_errors_per_second")
	start := time.Now()
	var lastOK, lastErr float64
	for time.Since(start) < 75*time.Second {
		el := time.Since(start)
		broker.down.Store(el >= 25*time.Second && el < 50*time.Second)
		time.Sleep(500 * time.Millisecond)
		m := scrape(t, reg)
		ok := m[`outbox_events_published_total{broker="rabbitmq",outcome="ok",topic="order"}`]
		bad := m[`outbox_publish_errors_total{broker="rabbitmq",class="transient"}`]
		fmt.Fprintf(f, "%.1f,%v,%.2f,%v,%.0f,%.0f\n", time.Since(start).Seconds(), m["outbox_pending_events"],
			m["outbox_oldest_pending_age_seconds"], m["outbox_stuck_events"], (ok-lastOK)*2, (bad-lastErr)*2)
		lastOK, lastErr = ok, bad
	}
}
