package logrelay_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/logrelay"
	"github.com/outboxhq/outbox/store/migrate"
)

// database creates a database of its own on the test server, migrated
// with the default names, and returns a pool on it; both go at cleanup.
func database(t *testing.T) (*pgxpool.Pool, store.Config) {
	t.Helper()
	admin := pgtest.NewPool(t)
	ctx := context.Background()
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	name := "outbox_db_" + hex.EncodeToString(b)
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := admin.Exec(context.Background(), "DROP DATABASE "+name+" WITH (FORCE)"); err != nil {
			t.Logf("drop database %s: %v", name, err)
		}
	})
	u, err := url.Parse(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + name
	pool, err := pgxpool.New(ctx, u.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	cfg, err := store.Config{}.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := migrate.Migrate(ctx, pool, cfg); err != nil {
		t.Fatal(err)
	}
	return pool, cfg
}

// Two services, each with its own database on one server and the default
// names: slot names are shared by the server's databases, so the default
// includes the database, an existing slot with the old default is kept by
// its own database, and a slot of another database is refused by name.
func TestTwoDatabasesOnOneServer(t *testing.T) {
	pgtest.Logical(t)
	ctx := context.Background()
	poolA, cfg := database(t)
	poolB, _ := database(t)
	var dbA, dbB string
	_ = poolA.QueryRow(ctx, "SELECT current_database()").Scan(&dbA)
	_ = poolB.QueryRow(ctx, "SELECT current_database()").Scan(&dbB)

	// A deployed before the default included the database: its slot has
	// the old default name, and keeps it.
	legacy := strings.ToLower("outbox_" + cfg.Schema + "_" + cfg.Table)
	if _, err := logrelay.CreateSlot(ctx, poolA, cfg, logrelay.Slot{Name: legacy}); err != nil {
		t.Fatal(err)
	}
	slotA, err := logrelay.Slot{}.Resolve(ctx, poolA, cfg)
	if err != nil || slotA.Name != legacy {
		t.Fatalf("A's slot = %q, %v; want its existing %q", slotA.Name, err, legacy)
	}
	slotB, err := logrelay.Slot{}.Resolve(ctx, poolB, cfg)
	if err != nil || slotB.Name == legacy || !strings.Contains(slotB.Name, dbB) || len(slotB.Name) > 63 {
		t.Fatalf("B's slot = %q, %v; want a name of its own with database %s", slotB.Name, err, dbB)
	}
	drop := func(pool *pgxpool.Pool) {
		if err := logrelay.DropSlot(context.Background(), pool, cfg, logrelay.Slot{}); err != nil {
			t.Logf("drop slot: %v", err)
		}
	}
	t.Cleanup(func() { drop(poolA) })
	t.Cleanup(func() { drop(poolB) })

	// Both relays publish their own database's events.
	for _, side := range []struct {
		pool *pgxpool.Pool
		db   string
	}{{poolA, dbA}, {poolB, dbB}} {
		pub := &recorder{}
		o := (&env{t: t, cfg: cfg}).opts()
		o.Slot = logrelay.Slot{}
		run := startRelay(t, side.pool, pub, o)
		w, err := outbox.NewLogWriter(outbox.WriterOptions{Store: cfg})
		if err != nil {
			t.Fatal(err)
		}
		rows, err := outbox.NewWriter(outbox.WriterOptions{Store: cfg})
		if err != nil {
			t.Fatal(err)
		}
		waitFor(t, 20*time.Second, "the relay of "+side.db+" reading its slot", func() bool {
			st, err := logrelay.Inspect(ctx, side.pool, cfg, logrelay.Slot{})
			return err == nil && st.Active && st.InThisDatabase
		})
		// The session that found no slot failed; the one reading the slot
		// it then created is healthy, and readiness says so.
		waitFor(t, 5*time.Second, "the relay of "+side.db+" ready", func() bool {
			return run.r.Holding() && run.r.Ready(0)[0].Err == nil
		})
		msgs := []outbox.Message{{AggregateID: uuid.NewString(), Type: "a.b", Payload: []byte(`{}`)}}
		if err := pgx.BeginFunc(ctx, side.pool, func(tx pgx.Tx) error {
			if err := rows.Write(ctx, tx, msgs...); err != nil {
				return err
			}
			return w.Write(ctx, tx, msgs[0])
		}); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 20*time.Second, "the events of "+side.db, func() bool { return len(pub.events()) == 2 })
		run.stop(t)
	}

	// A slot named explicitly after A's is refused in B, at once, naming
	// the slot and its database; the relay does not loop creating it.
	o := (&env{t: t, cfg: cfg}).opts()
	o.Slot = logrelay.Slot{Name: legacy}
	r, err := logrelay.New(poolB, &recorder{}, o)
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	start := time.Now()
	err = r.Run(rctx)
	if !errors.Is(err, logrelay.ErrSlotOfOtherDatabase) || !strings.Contains(err.Error(), legacy) || !strings.Contains(err.Error(), dbA) {
		t.Fatalf("relay on B with A's slot: %v, want ErrSlotOfOtherDatabase naming %s and %s", err, legacy, dbA)
	}
	t.Logf("refused after %v: %v", time.Since(start), err)
	if _, err := logrelay.CreateSlot(ctx, poolB, cfg, logrelay.Slot{Name: legacy}); !errors.Is(err, logrelay.ErrSlotOfOtherDatabase) {
		t.Fatalf("CreateSlot on B with A's slot: %v, want ErrSlotOfOtherDatabase", err)
	}
}
