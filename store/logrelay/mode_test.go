package logrelay_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/outboxhq/outbox/store/logrelay"
)

// Table mode and log mode on one outbox are refused, whichever starts
// second: a log relay stops with ErrMixedModes while a table-mode relay
// holds its lock, and `outbox slot create` refuses to hand rows over
// then; a table-mode relay is refused while a log relay reads the slot.
// Nothing refused them before, and both published every row.
func TestMixedModesAreRefused(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	table, err := logrelay.LockTableMode(ctx, e.pool, e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := logrelay.CreateSlot(ctx, e.pool, e.cfg, e.slot); !errors.Is(err, logrelay.ErrMixedModes) {
		t.Fatalf("CreateSlot beside a table-mode relay = %v, want ErrMixedModes", err)
	}
	if st := e.status(); st.Exists {
		t.Fatal("the slot was created beside a table-mode relay")
	}
	table.Release()
	e.createSlot()
	// A second table-mode lock is shared, not refused.
	t1, err := logrelay.LockTableMode(ctx, e.pool, e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	t2, err := logrelay.LockTableMode(ctx, e.pool, e.cfg)
	if err != nil {
		t.Fatalf("second table-mode relay: %v", err)
	}
	r := e.start(&recorder{}, e.opts())
	err = runErr(t, r, 10*time.Second)
	if !errors.Is(err, logrelay.ErrMixedModes) || !strings.Contains(err.Error(), e.cfg.Table) {
		t.Fatalf("log relay beside table-mode relays: Run = %v, want ErrMixedModes naming the table", err)
	}
	t1.Release()
	t2.Release()
	// Release closes the connections; their sessions end, and free the
	// lock, a moment later on the server.
	waitFor(t, 10*time.Second, "the table-mode locks to be freed", func() bool {
		conn, err := e.pool.Acquire(ctx)
		if err != nil {
			return false
		}
		defer conn.Release()
		var free bool
		key := "outbox table mode " + e.cfg.Schema + "." + e.cfg.Table
		if err := conn.QueryRow(ctx, `SELECT pg_try_advisory_lock(hashtextextended($1, 0))`, key).Scan(&free); err != nil || !free {
			return false
		}
		_, err = conn.Exec(ctx, `SELECT pg_advisory_unlock(hashtextextended($1, 0))`, key)
		return err == nil
	})

	log := e.start(&recorder{}, e.opts())
	waitFor(t, 10*time.Second, "the log relay to hold the slot", log.r.Holding)
	if _, err := logrelay.LockTableMode(ctx, e.pool, e.cfg); !errors.Is(err, logrelay.ErrMixedModes) {
		t.Fatalf("table-mode relay beside a log relay: %v, want ErrMixedModes", err)
	}
	log.stop(t)
	waitFor(t, 10*time.Second, "the slot to be free", func() bool { return !e.status().Active })
	again, err := logrelay.LockTableMode(ctx, e.pool, e.cfg)
	if err != nil {
		t.Fatalf("table-mode relay after the log relay stopped: %v", err)
	}
	again.Release()
}
