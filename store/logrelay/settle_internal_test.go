package logrelay

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
)

// A row the stream delivered whose transaction is not visible yet (with
// synchronous replication a commit stays invisible until a standby
// confirms it, for as long as that takes) is never counted done: the mark
// and the hand-off wait for it, past the 5s after which they used to give
// up and let the slot's position pass an event nobody recorded. A row
// whose transaction is visible and that is gone (deleted since) counts as
// gone at once. The uncommitted transaction stands in for the invisible
// commit: the relay sees neither its row nor its xid.
func TestMarkAndHandOffWaitForInvisibleRows(t *testing.T) {
	pgtest.Logical(t)
	pool, cfg := pgtest.Schema(t)
	cfg, err := cfg.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	slot, pid := holdSlot(t, pool, cfg)
	q, err := newStatements(cfg, slot)
	if err != nil {
		t.Fatal(err)
	}
	table := pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize()
	ctx := context.Background()
	log := slog.New(slog.DiscardHandler)

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	insert := func(tx pgx.Tx) *item {
		it := &item{row: true, txn: &txn{}}
		var xid int64
		err := tx.QueryRow(ctx, `INSERT INTO `+table+` (event_id, aggregate_id, type, payload)
VALUES (gen_random_uuid(), $1, 'order.placed', '{}') RETURNING seq, event_id::text, txid_current()`, uuid.NewString()).Scan(&it.ev.Seq, &it.ev.ID, &xid)
		if err != nil {
			t.Fatal(err)
		}
		it.txn.xid = uint32(xid)
		return it
	}
	toMark, toHand := insert(tx), insert(tx)

	type result struct {
		gone int
		err  error
		at   time.Time
	}
	marked, handed := make(chan result, 1), make(chan result, 1)
	go func() {
		gone, err := q.mark(ctx, pool, log, []*item{toMark})
		marked <- result{gone, err, time.Now()}
	}()
	go func() {
		err := q.handoff(ctx, pool, log, pid, toHand, nil)
		handed <- result{0, err, time.Now()}
	}()
	// 7s: past the old 5s give-up with room for a loaded machine.
	time.Sleep(7 * time.Second)
	committed := time.Now()
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	for name, ch := range map[string]chan result{"mark": marked, "hand-off": handed} {
		select {
		case r := <-ch:
			if r.err != nil || r.gone != 0 || r.at.Before(committed) {
				t.Errorf("%s returned %d gone, %v, %s before the commit; want it to wait for the row", name, r.gone, r.err, committed.Sub(r.at))
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%s did not finish 10s after the commit", name)
		}
	}
	var dispatched, handedOff int
	if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE dispatched_at IS NOT NULL), count(*) FILTER (WHERE handoff_at IS NOT NULL) FROM `+table).Scan(&dispatched, &handedOff); err != nil {
		t.Fatal(err)
	}
	if dispatched != 1 || handedOff != 1 {
		t.Errorf("%d rows dispatched, %d handed off; want 1 and 1", dispatched, handedOff)
	}

	// Visible, then deleted: gone, without waiting.
	tx2, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	deleted := insert(tx2)
	if err := tx2.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `DELETE FROM `+table+` WHERE seq = $1`, deleted.ev.Seq); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	gone, err := q.mark(ctx, pool, log, []*item{deleted})
	if err != nil || gone != 1 || time.Since(start) > 3*time.Second {
		t.Errorf("mark of a deleted row: %d gone, %v after %s; want 1 at once", gone, err, time.Since(start))
	}
}

// holdSlot creates the outbox's slot and reads it over a replication
// connection of its own, returning the slot and that walsender's pid.
func holdSlot(t *testing.T, pool *pgxpool.Pool, cfg store.Config) (Slot, uint32) {
	t.Helper()
	ctx := context.Background()
	slot, err := Slot{}.Resolve(ctx, pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := CreateSlot(ctx, pool, cfg, slot); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = DropSlot(context.Background(), pool, cfg, slot) })
	conn := startReading(t, pool, slot)
	return slot, conn.PID()
}

// startReading opens a replication connection and starts reading slot.
func startReading(t *testing.T, pool *pgxpool.Pool, slot Slot) *pgconn.PgConn {
	t.Helper()
	ctx := context.Background()
	conn, err := replicationConn(ctx, pool, nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	err = pglogrepl.StartReplication(ctx, conn, slot.Name, 0, pglogrepl.StartReplicationOptions{
		Mode: pglogrepl.LogicalReplication, PluginArgs: []string{"proto_version '1'", "publication_names '" + slot.Publication + "'"},
	})
	if err != nil {
		t.Fatal(err)
	}
	return conn
}
