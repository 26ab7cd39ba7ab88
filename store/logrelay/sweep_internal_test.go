package logrelay

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// The relay's memory of handed-off aggregates is bounded by those with
// something pending handed off: scheduled events with one-off keys, once
// the table path has published them, are forgotten by a sweep, not kept
// for the whole session (an entry used to go only when a later event of
// its aggregate arrived). An aggregate still pending stays, and its next
// event follows it to the table.
func TestHandedOffAggregatesAreForgottenOnceDone(t *testing.T) {
	pgtest.Logical(t)
	pool, cfg := pgtest.Schema(t)
	cfg, err := cfg.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	slot, err := Slot{}.Resolve(ctx, pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := CreateSlot(ctx, pool, cfg, slot); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = DropSlot(context.Background(), pool, cfg, slot) })
	pub := &published{}
	r, err := New(pool, pub, Options{Store: cfg, Slot: slot, ManualSlot: true, StatusInterval: 100 * time.Millisecond,
		Options: core.Options{Lanes: 8, ErrorBackoff: core.Backoff{Min: 5 * time.Millisecond, Max: 100 * time.Millisecond}}})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	fn, err := cfg.LogWriteFunc()
	if err != nil {
		t.Fatal(err)
	}
	write := func(agg, due string) {
		t.Helper()
		_, err := pool.Exec(ctx, `SELECT `+fn+`(json_build_object('v', 1, 'event_id', gen_random_uuid(), 'aggregate_id', $1::text,
    'type', 'order.placed', 'deliver_at', `+due+`, 'payload', '{}'::json)::text)`, agg)
		if err != nil {
			t.Fatal(err)
		}
	}
	table := pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize()
	count := func(where string) int {
		t.Helper()
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+table+` WHERE `+where).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	known := func() (n int, kept bool) {
		s := r.current.Load()
		if s == nil {
			return 0, false
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		_, kept = s.handedOff["kept"]
		return len(s.handedOff), kept
	}
	const oneOff = 2 * minSweep
	write("kept", "now() + interval '1 hour'")
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `SELECT `+fn+`(json_build_object('v', 1, 'event_id', gen_random_uuid(), 'aggregate_id', 'one-off-' || i,
    'type', 'order.placed', 'deliver_at', now() + interval '1 hour', 'payload', '{}'::json)::text) FROM generate_series(1, $1) i`, oneOff)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 60*time.Second, fmt.Sprintf("%d scheduled events handed off", oneOff+1), func() bool {
		return count("handoff_at IS NOT NULL") == oneOff+1
	})
	if n, kept := known(); n != oneOff+1 || !kept {
		t.Fatalf("%d handed-off aggregates known (kept: %v), want %d", n, kept, oneOff+1)
	}
	// The table path publishes the one-off events.
	if _, err := pool.Exec(ctx, `UPDATE `+table+` SET dispatched_at = now() WHERE aggregate_id LIKE 'one-off-%'`); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 10*time.Second, "the done aggregates forgotten", func() bool {
		n, _ := known()
		return n < minSweep
	})
	if n, kept := known(); n != 1 || !kept {
		t.Fatalf("%d handed-off aggregates known after the sweep (kept: %v), want only the pending one", n, kept)
	}
	write("kept", "now()")
	waitUntil(t, 10*time.Second, "the pending aggregate's next event handed off behind it", func() bool {
		return count("aggregate_id = 'kept' AND handoff_at IS NOT NULL") == 2
	})
	if pub.has("kept") {
		t.Fatal("the pending aggregate's next event went out ahead of its handed-off one")
	}
}

func waitUntil(t *testing.T, d time.Duration, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s", what, d)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
