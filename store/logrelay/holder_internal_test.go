package logrelay

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// A relay that lost the slot to another (cut off from the server while
// still running) hands nothing off: its hand-off would come after the
// new holder listed the handed-off aggregates, and the new holder would
// publish the aggregate's later events from the log ahead of it. Here the
// first walsender's pid is refused once a second connection holds the
// slot, rows and log-only events alike, and nothing reaches the table;
// the holder's hand-off goes through.
func TestHandOffOnlyByTheSlotsHolder(t *testing.T) {
	pgtest.Logical(t)
	pool, cfg := pgtest.Schema(t)
	cfg, err := cfg.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	slot, oldPID := holdSlot(t, pool, cfg)
	q, err := newStatements(cfg, slot)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	log := slog.New(slog.DiscardHandler)
	table := pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize()

	row := &item{row: true, txn: &txn{}}
	if err := pool.QueryRow(ctx, `INSERT INTO `+table+` (event_id, aggregate_id, type, payload)
VALUES (gen_random_uuid(), $1, 'order.placed', '{}') RETURNING seq, event_id::text`, uuid.NewString()).Scan(&row.ev.Seq, &row.ev.ID); err != nil {
		t.Fatal(err)
	}
	msg := &item{ev: row.ev}
	msg.ev.ID, msg.ev.Seq, msg.ev.Type, msg.ev.Payload = uuid.NewString(), 0, "order.paid", []byte(`{}`)

	// The old holder's walsender ends; another connection takes the slot.
	if _, err := pool.Exec(ctx, "SELECT pg_terminate_backend($1)", int64(oldPID)); err != nil {
		t.Fatal(err)
	}
	var newPID uint32
	for range 100 {
		var active bool
		if err := pool.QueryRow(ctx, "SELECT active FROM pg_replication_slots WHERE slot_name = $1", slot.Name).Scan(&active); err != nil {
			t.Fatal(err)
		}
		if !active {
			newPID = startReading(t, pool, slot).PID()
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if newPID == 0 {
		t.Fatal("the old walsender did not let the slot go")
	}
	for _, it := range []*item{row, msg} {
		if err := q.handoff(ctx, pool, log, oldPID, it, nil); !errors.Is(err, errNotHolder) {
			t.Errorf("hand-off by the old holder (row %v) = %v, want errNotHolder", it.row, err)
		}
	}
	var handed int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+table+" WHERE handoff_at IS NOT NULL").Scan(&handed); err != nil {
		t.Fatal(err)
	}
	if handed != 0 {
		t.Fatalf("%d rows handed off by a relay that lost the slot", handed)
	}
	for _, it := range []*item{row, msg} {
		if err := q.handoff(ctx, pool, log, newPID, it, nil); err != nil {
			t.Errorf("hand-off by the holder (row %v) = %v", it.row, err)
		}
	}
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+table+" WHERE handoff_at IS NOT NULL").Scan(&handed); err != nil {
		t.Fatal(err)
	}
	if handed != 2 {
		t.Fatalf("%d rows handed off by the holder, want 2", handed)
	}
}
