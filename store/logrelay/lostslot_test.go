package logrelay_test

import (
	"context"
	"testing"

	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store/logrelay"
)

// A slot the server invalidated (wal_status lost: it fell behind
// max_slot_wal_keep_size) decodes nothing more: log-only writes are
// refused from then on. They used to pass while the slot existed.
func TestLogOnlyWriteRefusedOnAnInvalidatedSlot(t *testing.T) {
	srv := pgtest.Private(t, map[string]string{"max_slot_wal_keep_size": "'1MB'"})
	pool := srv.Pool(t)
	ctx := context.Background()
	e := privateOutbox(t, pool, "outbox_lost")
	cfg, slot := e.cfg, e.slot
	if !e.logOnlyAccepted(pool) {
		t.Fatal("log-only write refused with a valid slot")
	}
	// WAL past the slot's keep size, then a checkpoint: the server
	// invalidates the slot, which nobody reads.
	for range 4 {
		if _, err := pool.Exec(ctx, `SELECT pg_logical_emit_message(false, 'filler', repeat('x', 1000)), pg_switch_wal()`); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := pool.Exec(ctx, `CHECKPOINT`); err != nil {
		t.Fatal(err)
	}
	if st, err := logrelay.Inspect(ctx, pool, cfg, slot); err != nil || st.WALStatus != "lost" {
		t.Fatalf("slot status %+v, %v; want wal_status lost", st, err)
	}
	if e.logOnlyAccepted(pool) {
		t.Fatal("log-only write accepted on an invalidated slot")
	}
}
