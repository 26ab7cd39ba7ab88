package dedupe_test

import (
	"context"
	"database/sql"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/stdlib"
	_ "github.com/lib/pq"

	"github.com/outboxhq/outbox/core/event"
	"github.com/outboxhq/outbox/dedupe"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// The database/sql deduper keeps the guarantees of the pgx one with either
// driver: once per event, rolled back with a failing handler, a concurrent
// duplicate waits and is skipped, and the middleware's handler writes in
// the same transaction.
func TestSQLDeduper(t *testing.T) {
	for _, driver := range []string{"pgx", "postgres"} {
		t.Run(driver, func(t *testing.T) {
			ctx := context.Background()
			pool, cfg := pgtest.Schema(t)
			_, effects := newCounter(t, cfg)
			table := cfg.Schema + ".effects"
			var db *sql.DB
			if driver == "pgx" {
				db = stdlib.OpenDBFromPool(pool)
			} else {
				var err error
				if db, err = sql.Open("postgres", pgtest.URL(t)); err != nil {
					t.Fatal(err)
				}
			}
			t.Cleanup(func() { _ = db.Close() })
			d, err := dedupe.NewSQL(db, dedupe.Options{Consumer: "billing", Store: cfg})
			if err != nil {
				t.Fatal(err)
			}
			apply := func(ctx context.Context, tx *sql.Tx) error {
				if got, ok := dedupe.TxFromContext[*sql.Tx](ctx); !ok || got != tx {
					return errors.New("the context does not carry the transaction")
				}
				_, err := tx.ExecContext(ctx, `INSERT INTO `+table+` DEFAULT VALUES`)
				return err
			}

			id := uuid.NewString()
			for i, want := range []bool{true, false} {
				applied, err := d.Process(ctx, id, apply)
				if err != nil || applied != want {
					t.Fatalf("delivery %d: applied %v, %v; want %v", i, applied, err, want)
				}
			}
			failing := uuid.NewString()
			boom := errors.New("boom")
			if _, err := d.Process(ctx, failing, func(ctx context.Context, tx *sql.Tx) error {
				if err := apply(ctx, tx); err != nil {
					return err
				}
				return boom
			}); !errors.Is(err, boom) {
				t.Fatalf("failing handler: %v", err)
			}
			if applied, err := d.Process(ctx, failing, apply); err != nil || !applied {
				t.Fatalf("redelivery after a failure: applied %v, %v; want it to run", applied, err)
			}
			if n := effects(); n != 2 {
				t.Fatalf("%d effects, want 2", n)
			}

			// Two deliveries at once: the second waits for the first and
			// is skipped when it commits.
			concurrent := uuid.NewString()
			var wg sync.WaitGroup
			var ran atomic.Int64
			for range 2 {
				wg.Go(func() {
					_, err := d.Process(ctx, concurrent, func(ctx context.Context, tx *sql.Tx) error {
						ran.Add(1)
						time.Sleep(100 * time.Millisecond)
						return apply(ctx, tx)
					})
					if err != nil {
						t.Errorf("concurrent delivery: %v", err)
					}
				})
			}
			wg.Wait()
			if ran.Load() != 1 || effects() != 3 {
				t.Fatalf("concurrent duplicates ran %d times, %d effects; want once", ran.Load(), effects())
			}

			h := d.NoPublishHandler(func(ctx context.Context, tx *sql.Tx, msg *message.Message) error { return apply(ctx, tx) })
			eventID := uuid.NewString()
			for range 2 {
				msg := message.NewMessage(uuid.NewString(), []byte(`{}`))
				msg.Metadata.Set(event.HeaderEventID, eventID)
				if err := h(msg); err != nil {
					t.Fatal(err)
				}
			}
			if n := effects(); n != 4 {
				t.Fatalf("%d effects after a message delivered twice, want 4", n)
			}
			deleted, err := d.Cleanup(ctx, time.Nanosecond, 2)
			if err != nil || deleted != 4 {
				t.Fatalf("cleanup deleted %d (%v), want the 4 records", deleted, err)
			}
		})
	}
	if _, err := dedupe.NewSQL(nil, dedupe.Options{Consumer: "c"}); err == nil {
		t.Error("a nil db was accepted")
	}
}
