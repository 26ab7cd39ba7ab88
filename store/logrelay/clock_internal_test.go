package logrelay

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// published records the events a relay publishes.
type published struct {
	mu   sync.Mutex
	aggs []string
}

func (p *published) Publish(_ context.Context, e *core.Event) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.aggs = append(p.aggs, e.AggregateID)
	return nil
}

func (p *published) Close() error { return nil }

func (p *published) has(agg string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, a := range p.aggs {
		if a == agg {
			return true
		}
	}
	return false
}

// A log-only event's deliver_at is the database's time: the relay compares
// it with the database's clock, not its host's. With the host an hour
// ahead, an event due in half an hour is handed to the table path to wait;
// compared with the host's clock it used to go out at once.
func TestDeliverAtComparedWithTheDatabaseClock(t *testing.T) {
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
	hostClock = func() time.Time { return time.Now().Add(time.Hour) }
	t.Cleanup(func() { hostClock = time.Now })

	pub := &published{}
	r, err := New(pool, pub, Options{Store: cfg, Slot: slot, ManualSlot: true, StatusInterval: 100 * time.Millisecond,
		Options: core.Options{ErrorBackoff: core.Backoff{Min: 5 * time.Millisecond, Max: 100 * time.Millisecond}}})
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
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for agg, due := range map[string]string{"later": "now() + interval '30 minutes'", "due": "now()"} {
			_, err := tx.Exec(ctx, `SELECT `+fn+`(json_build_object('v', 1, 'event_id', gen_random_uuid(), 'aggregate_id', $1::text,
    'type', 'order.placed', 'deliver_at', `+due+`, 'payload', '{}'::json)::text)`, agg)
			if err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	table := pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize()
	deadline := time.Now().Add(20 * time.Second)
	for {
		var waiting bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+table+` WHERE aggregate_id = 'later' AND handoff_at IS NOT NULL AND dispatched_at IS NULL)`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if pub.has("later") {
			t.Fatal("the event due in 30 minutes (by the database's clock) was published at once")
		}
		if waiting && pub.has("due") {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal(errors.New("the due event published and the later one handed off: not within 20s"))
		}
		time.Sleep(50 * time.Millisecond)
	}
}
