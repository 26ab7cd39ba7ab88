package logrelay_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/logrelay"
)

// Table mode and log mode on one outbox are refused, whichever starts
// second: a log relay stops with ErrMixedModes while a table-mode relay
// holds its lock, and `outbox slot create` refuses to hand rows over
// then; a table-mode relay is refused while a log relay reads the slot.
// Nothing refused them before, and both published every row. The table
// side is held here by its lock's key, which relays of older and newer
// releases share.
func TestMixedModesAreRefused(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	release := holdTableMode(t, e)
	if _, err := logrelay.CreateSlot(ctx, e.pool, e.cfg, e.slot); !errors.Is(err, store.ErrMixedModes) {
		t.Fatalf("CreateSlot beside a table-mode relay = %v, want ErrMixedModes", err)
	}
	if st := e.status(); st.Exists {
		t.Fatal("the slot was created beside a table-mode relay")
	}
	release()
	e.createSlot()
	// A second table-mode lock is shared, not refused.
	release1, release2 := holdTableMode(t, e), holdTableMode(t, e)
	r := e.start(&recorder{}, e.opts())
	err := runErr(t, r, 10*time.Second)
	if !errors.Is(err, store.ErrMixedModes) || !strings.Contains(err.Error(), e.cfg.Table) {
		t.Fatalf("log relay beside table-mode relays: Run = %v, want ErrMixedModes naming the table", err)
	}
	release1()
	release2()
	// Release closes the connections; their sessions end, and free the
	// lock, a moment later on the server.
	waitFor(t, 10*time.Second, "the table-mode locks to be freed", func() bool {
		conn, err := e.pool.Acquire(ctx)
		if err != nil {
			return false
		}
		defer conn.Release()
		var free bool
		if err := conn.QueryRow(ctx, `SELECT pg_try_advisory_lock(hashtextextended($1, 0))`, tableModeKey(e)).Scan(&free); err != nil || !free {
			return false
		}
		_, err = conn.Exec(ctx, `SELECT pg_advisory_unlock(hashtextextended($1, 0))`, tableModeKey(e))
		return err == nil
	})

	log := e.start(&recorder{}, e.opts())
	waitFor(t, 10*time.Second, "the log relay to hold the slot", log.r.Holding)
	if err := tableModeFree(t, e); !errors.Is(err, store.ErrMixedModes) {
		t.Fatalf("table-mode relay beside a log relay: %v, want ErrMixedModes", err)
	}
	log.stop(t)
	// As above: the stopped relay's session frees its lock a moment
	// after Run returns, on the server.
	waitFor(t, 10*time.Second, "a table-mode relay to be let start after the log relay stopped", func() bool {
		return tableModeFree(t, e) == nil
	})
}

// tableModeKey is the key of the table-mode lock on e's outbox.
func tableModeKey(e *env) string { return "outbox table mode " + e.cfg.Schema + "." + e.cfg.Table }

// holdTableMode takes the table-mode lock on e's outbox, shared, on a
// connection of its own, as a table-mode relay does; release closes the
// connection.
func holdTableMode(t *testing.T, e *env) (release func()) {
	t.Helper()
	ctx := context.Background()
	conn, err := e.pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock_shared(hashtextextended($1, 0))", tableModeKey(e)); err != nil {
		conn.Release()
		t.Fatal(err)
	}
	return func() { _ = conn.Hijack().Close(ctx) }
}

// tableModeFree is a table-mode relay's check before it starts: nil, or
// ErrMixedModes while a log relay holds its lock on e's outbox.
func tableModeFree(t *testing.T, e *env) error {
	t.Helper()
	ctx := context.Background()
	conn, err := e.pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	return store.OtherModeFree(ctx, conn.Conn().PgConn(), e.cfg, "log")
}
