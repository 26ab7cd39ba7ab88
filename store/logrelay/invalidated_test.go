package logrelay_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/logrelay"
)

// A slot the server invalidated, for every reason the server version
// has that a relay's slot can meet, is reported (Inspect: wal_status
// lost and, from PostgreSQL 17 on, the reason), refused by a relay with
// ErrSlotLost, and recovered by `outbox slot drop` and `outbox slot
// create`, which hands the pending rows to the table path. Create used to
// take the lost slot for a good one and do nothing. On a server of the test's own, from the test
// server's binaries: invalidating a slot needs server-wide settings
// (max_slot_wal_keep_size; on 18, idle_replication_slot_timeout).
func TestInvalidatedSlotIsReported(t *testing.T) {
	bin := os.Getenv("OUTBOX_TEST_PG_BIN")
	if bin == "" {
		t.Skip("OUTBOX_TEST_PG_BIN is not set: scripts/services.sh names the test server's binaries")
	}
	ctx := context.Background()
	srv := pgtest.Start(t, pgtest.Options{Bin: bin})
	admin := connect(t, srv.URL)
	// Set here, not in postgresql.conf, so that ALTER SYSTEM RESET takes it away.
	for _, q := range []string{"CREATE DATABASE outbox_test", "ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'", "SELECT pg_reload_conf()"} {
		if _, err := admin.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	admin.Close()
	pool := connect(t, srv.Database("outbox_test"))
	var version int
	if err := pool.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
		t.Fatal(err)
	}

	// setUp makes an outbox and its slot.
	setUp := func(schema string) (store.Config, logrelay.Slot) {
		t.Helper()
		e := privateOutbox(t, pool, schema)
		return e.cfg, e.slot
	}
	// lost waits for the server to invalidate the slot at a checkpoint,
	// while more is written, and checks what Inspect and a relay say.
	lost := func(cfg store.Config, slot logrelay.Slot, reason string) {
		t.Helper()
		table := pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize()
		var st logrelay.SlotStatus
		waitFor(t, 60*time.Second, "the slot invalidated", func() bool {
			for _, q := range []string{
				"INSERT INTO " + table + " (event_id, aggregate_id, type, payload) SELECT gen_random_uuid(), 'a', 'order.placed', '{}' FROM generate_series(1, 100)",
				"SELECT pg_switch_wal()",
				"CHECKPOINT",
			} {
				if _, err := pool.Exec(ctx, q); err != nil {
					t.Fatalf("%s: %v", q, err)
				}
			}
			var err error
			if st, err = logrelay.Inspect(ctx, pool, cfg, slot); err != nil {
				t.Fatal(err)
			}
			return st.WALStatus == "lost"
		})
		if version < 170000 {
			reason = "" // the server does not say
		}
		if st.InvalidationReason != reason {
			t.Errorf("slot invalidated with reason %q, want %q", st.InvalidationReason, reason)
		}
		err := runUntilDone(t, pool, logrelay.Options{Store: cfg, Slot: slot, ManualSlot: true})
		if !errors.Is(err, logrelay.ErrSlotLost) || !strings.Contains(err.Error(), slot.Name) {
			t.Errorf("relay on the invalidated slot: %v, want ErrSlotLost naming it", err)
		}

		// The recovery: create refuses the lost slot, naming the fix; drop
		// and create hand every pending row (none was relayed) to the
		// table path.
		if _, err := logrelay.CreateSlot(ctx, pool, cfg, slot); !errors.Is(err, logrelay.ErrSlotLost) || !strings.Contains(err.Error(), "outbox slot drop") {
			t.Errorf("create on the invalidated slot: %v, want ErrSlotLost naming the fix", err)
		}
		var pending int64
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+table+" WHERE dispatched_at IS NULL").Scan(&pending); err != nil {
			t.Fatal(err)
		}
		if err := logrelay.DropSlot(ctx, pool, cfg, slot); err != nil {
			t.Fatal(err)
		}
		c, err := logrelay.CreateSlot(ctx, pool, cfg, slot)
		if err != nil || !c.Slot || c.HandedOff != pending {
			t.Errorf("create after the drop: %+v, %v; want the slot made and %d pending rows handed off", c, err, pending)
		}
		if st, err := logrelay.Inspect(ctx, pool, cfg, slot); err != nil || st.WALStatus == "lost" {
			t.Errorf("the slot created again: wal_status %q, %v", st.WALStatus, err)
		}
	}

	cfg, slot := setUp("walremoved")
	lost(cfg, slot, "wal_removed")

	if version >= 180000 {
		for _, q := range []string{
			"ALTER SYSTEM RESET max_slot_wal_keep_size",
			"ALTER SYSTEM SET idle_replication_slot_timeout = '1s'",
			"SELECT pg_reload_conf()",
		} {
			if _, err := pool.Exec(ctx, q); err != nil {
				t.Fatalf("%s: %v", q, err)
			}
		}
		cfg, slot := setUp("idle")
		time.Sleep(1500 * time.Millisecond)
		lost(cfg, slot, "idle_timeout")
	}
}

// runUntilDone runs a relay and returns what Run returned, within 30s.
func runUntilDone(t *testing.T, pool *pgxpool.Pool, o logrelay.Options) error {
	t.Helper()
	o.Logger = testLogger(t)
	r, err := logrelay.New(pool, &recorder{}, o)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := r.Run(ctx); err != nil {
		return err
	}
	return fmt.Errorf("Run returned nil after %v", ctx.Err())
}
