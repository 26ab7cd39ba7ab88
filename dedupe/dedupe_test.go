package dedupe_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/dedupe"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/migrate"
)

func TestNewRejectsBadOptions(t *testing.T) {
	pool := pgtest.NewPool(t)
	for _, tc := range []struct {
		name string
		opts dedupe.Options
		want string
	}{
		{"no consumer", dedupe.Options{}, "Consumer is required"},
		{"blank consumer", dedupe.Options{Consumer: "  "}, "Consumer is required"},
		{"long consumer", dedupe.Options{Consumer: strings.Repeat("c", 201)}, "Consumer is longer"},
		{"control in consumer", dedupe.Options{Consumer: "a\nb"}, "control characters"},
		{"unknown policy", dedupe.Options{Consumer: "c", MissingID: 7}, "MissingID 7"},
		{"bad store", dedupe.Options{Consumer: "c", Store: store.Config{ProcessedTable: "events_outbox"}}, "must differ"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := dedupe.New(pool, tc.opts)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error = %v, want one containing %q", err, tc.want)
			}
		})
	}
	if _, err := dedupe.New(nil, dedupe.Options{Consumer: "c"}); err == nil {
		t.Error("a nil pool was accepted")
	}
}

// counter is an effect Process applies: one row per run.
type counter struct {
	table string
	runs  atomic.Int64
}

func newCounter(t *testing.T, cfg store.Config) (*counter, func() int) {
	t.Helper()
	pool := pgtest.NewPool(t)
	c := &counter{table: pgx.Identifier{cfg.Schema, "effects"}.Sanitize()}
	if _, err := pool.Exec(context.Background(), `CREATE TABLE `+c.table+` (id BIGSERIAL PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	return c, func() int {
		var n int
		if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM `+c.table).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
}

func (c *counter) apply(ctx context.Context, tx pgx.Tx) error {
	c.runs.Add(1)
	_, err := tx.Exec(ctx, `INSERT INTO `+c.table+` DEFAULT VALUES`)
	return err
}

func TestProcessRunsOncePerEvent(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	c, effects := newCounter(t, cfg)
	d := newDeduper(t, pool, cfg, "billing")
	ctx := context.Background()
	id := uuid.NewString()
	for i, want := range []bool{true, false, false} {
		applied, err := d.Process(ctx, id, func(ctx context.Context, tx pgx.Tx) error {
			if got, ok := dedupe.TxFromContext[pgx.Tx](ctx); !ok || got != tx {
				t.Error("the context does not carry the transaction")
			}
			return c.apply(ctx, tx)
		})
		if err != nil {
			t.Fatalf("delivery %d: %v", i, err)
		}
		if applied != want {
			t.Errorf("delivery %d: applied = %v, want %v", i, applied, want)
		}
	}
	if n := effects(); n != 1 {
		t.Errorf("effects = %d, want 1", n)
	}
	// Another event, and the same event for another consumer, are new.
	if applied, err := d.Process(ctx, uuid.NewString(), c.apply); err != nil || !applied {
		t.Errorf("another event: applied %v, err %v", applied, err)
	}
	other := newDeduper(t, pool, cfg, "shipping")
	if applied, err := other.Process(ctx, id, c.apply); err != nil || !applied {
		t.Errorf("another consumer: applied %v, err %v", applied, err)
	}
	if n := effects(); n != 3 {
		t.Errorf("effects = %d, want 3", n)
	}
}

func TestProcessRollsBackOnErrorAndPanic(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	c, effects := newCounter(t, cfg)
	d := newDeduper(t, pool, cfg, "billing")
	ctx := context.Background()
	id := uuid.NewString()

	boom := errors.New("boom")
	applied, err := d.Process(ctx, id, func(ctx context.Context, tx pgx.Tx) error {
		if err := c.apply(ctx, tx); err != nil {
			return err
		}
		return boom
	})
	if !errors.Is(err, boom) || applied {
		t.Fatalf("failing fn: applied %v, err %v; want false and the fn's error", applied, err)
	}

	func() {
		defer func() {
			if r := recover(); r != "bug" {
				t.Errorf("recovered %v, want the fn's panic", r)
			}
		}()
		_, _ = d.Process(ctx, id, func(ctx context.Context, tx pgx.Tx) error {
			if err := c.apply(ctx, tx); err != nil {
				return err
			}
			panic("bug")
		})
	}()

	if n := effects(); n != 0 {
		t.Fatalf("effects after failures = %d, want 0 (rolled back)", n)
	}
	if applied, err := d.Process(ctx, id, c.apply); err != nil || !applied {
		t.Fatalf("retry: applied %v, err %v; want it to run", applied, err)
	}
	if n := effects(); n != 1 {
		t.Errorf("effects = %d, want 1", n)
	}
	// The panic gave its connection back.
	if st := pool.Stat(); st.AcquiredConns() != 0 {
		t.Errorf("%d connections still acquired", st.AcquiredConns())
	}
}

func TestProcessConcurrentDuplicate(t *testing.T) {
	for _, firstFails := range []bool{false, true} {
		t.Run(map[bool]string{false: "first commits", true: "first rolls back"}[firstFails], func(t *testing.T) {
			pool, cfg := pgtest.Schema(t)
			c, effects := newCounter(t, cfg)
			d := newDeduper(t, pool, cfg, "billing")
			ctx := context.Background()
			id := uuid.NewString()

			firstIn := make(chan struct{})
			var first struct {
				applied bool
				err     error
			}
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				first.applied, first.err = d.Process(ctx, id, func(ctx context.Context, tx pgx.Tx) error {
					close(firstIn)
					if err := c.apply(ctx, tx); err != nil {
						return err
					}
					if err := waitForLockWaiter(ctx, pool, cfg.Schema); err != nil {
						return err
					}
					if firstFails {
						return errors.New("first fails")
					}
					return nil
				})
			}()
			<-firstIn
			applied, err := d.Process(ctx, id, c.apply)
			wg.Wait()

			if err != nil {
				t.Fatalf("duplicate: %v", err)
			}
			if firstFails {
				if first.err == nil || first.applied || !applied {
					t.Errorf("first (%v, %v), duplicate applied %v; want the duplicate to run", first.applied, first.err, applied)
				}
			} else if first.err != nil || !first.applied || applied {
				t.Errorf("first (%v, %v), duplicate applied %v; want only the first to run", first.applied, first.err, applied)
			}
			if n := effects(); n != 1 {
				t.Errorf("effects = %d, want 1", n)
			}
		})
	}
}

func TestProcessRejectsBadEventID(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	d := newDeduper(t, pool, cfg, "billing")
	for _, id := range []string{"", " x", "a\x00b", strings.Repeat("x", dedupe.MaxEventIDBytes+1), "\xff"} {
		_, err := d.Process(context.Background(), id, func(context.Context, pgx.Tx) error {
			t.Errorf("fn ran for event id %q", id)
			return nil
		})
		if !errors.Is(err, dedupe.ErrNoEventID) {
			t.Errorf("event id %q: error %v, want ErrNoEventID", id, err)
		}
	}
}

func TestCleanup(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	ctx := context.Background()
	d := newDeduper(t, pool, cfg, "billing")
	other := newDeduper(t, pool, cfg, "shipping")
	nop := func(context.Context, pgx.Tx) error { return nil }
	var oldIDs []string
	for i := 0; i < 10; i++ {
		id := uuid.NewString()
		oldIDs = append(oldIDs, id)
		for _, dd := range []*dedupe.Deduper[pgx.Tx]{d, other} {
			if _, err := dd.Process(ctx, id, nop); err != nil {
				t.Fatal(err)
			}
		}
	}
	recent := uuid.NewString()
	if _, err := d.Process(ctx, recent, nop); err != nil {
		t.Fatal(err)
	}
	table := pgx.Identifier{cfg.Schema, "processed_events"}.Sanitize()
	if _, err := pool.Exec(ctx, `UPDATE `+table+` SET processed_at = now() - interval '8 days' WHERE event_id = ANY($1)`, oldIDs); err != nil {
		t.Fatal(err)
	}

	for _, bad := range []struct {
		older time.Duration
		batch int
		want  string
	}{{0, 10, "olderThan"}, {time.Hour, 0, "batchSize"}} {
		if _, err := d.Cleanup(ctx, bad.older, bad.batch); err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("Cleanup(%v, %d): error %v, want one naming %s", bad.older, bad.batch, err, bad.want)
		}
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := d.Cleanup(cancelled, time.Hour, 3); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled Cleanup: error %v, want context.Canceled", err)
	}

	deleted, err := d.Cleanup(ctx, 7*24*time.Hour, 3) // four batches: 3+3+3+1
	if err != nil {
		t.Fatal(err)
	}
	if deleted != 10 {
		t.Errorf("deleted %d, want 10", deleted)
	}
	if n := processedCount(t, pool, cfg, "billing"); n != 1 {
		t.Errorf("billing rows left = %d, want 1 (the recent one)", n)
	}
	if n := processedCount(t, pool, cfg, "shipping"); n != 10 {
		t.Errorf("shipping rows left = %d, want 10 (another consumer's)", n)
	}
	// Past the window an event is new again, and within it not.
	if applied, _ := d.Process(ctx, oldIDs[0], nop); !applied {
		t.Error("a cleaned-up event was still known")
	}
	if applied, _ := d.Process(ctx, recent, nop); applied {
		t.Error("a retained event ran again")
	}
}

func TestProcessUsesConfiguredTable(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	ctx := context.Background()
	custom := store.Config{Schema: cfg.Schema, Table: "orders outbox", ProcessedTable: "Inbox"}
	if _, err := migrate.Migrate(ctx, pool, custom); err != nil {
		t.Fatal(err)
	}
	d, err := dedupe.New(pool, dedupe.Options{Consumer: "billing", Store: custom})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.Process(ctx, uuid.NewString(), func(context.Context, pgx.Tx) error { return nil }); err != nil {
		t.Fatal(err)
	}
	var inCustom, inDefault int
	err = pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+pgx.Identifier{cfg.Schema, "Inbox"}.Sanitize()+`),
       (SELECT count(*) FROM `+pgx.Identifier{cfg.Schema, "processed_events"}.Sanitize()+`)`).Scan(&inCustom, &inDefault)
	if err != nil {
		t.Fatal(err)
	}
	if inCustom != 1 || inDefault != 0 {
		t.Errorf("rows in the configured table %d, in the default one %d; want 1 and 0", inCustom, inDefault)
	}
}

// The cost the record adds to a handler's transaction, per event.
func BenchmarkProcess(b *testing.B) {
	pool, cfg := pgtest.Schema(b)
	ctx := context.Background()
	d, err := dedupe.New(pool, dedupe.Options{Consumer: "bench", Store: cfg})
	if err != nil {
		b.Fatal(err)
	}
	nop := func(context.Context, pgx.Tx) error { return nil }
	b.Run("new", func(b *testing.B) {
		for b.Loop() {
			if _, err := d.Process(ctx, uuid.NewString(), nop); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("duplicate", func(b *testing.B) {
		id := uuid.NewString()
		if _, err := d.Process(ctx, id, nop); err != nil {
			b.Fatal(err)
		}
		for b.Loop() {
			if applied, err := d.Process(ctx, id, nop); err != nil || applied {
				b.Fatalf("applied %v, err %v", applied, err)
			}
		}
	})
	b.Run("transaction only", func(b *testing.B) {
		for b.Loop() {
			if err := pgx.BeginFunc(ctx, pool, func(pgx.Tx) error { return nil }); err != nil {
				b.Fatal(err)
			}
		}
	})
}
