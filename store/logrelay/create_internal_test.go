package logrelay

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// Creating the slot and handing off the rows committed before it are one
// step as far as a crash can tell: a crash after the hand-off leaves no
// slot (the slot is made last, from a temporary one), so the next attempt
// creates it and hands off what is still pending. The slot used to be
// made first: a crash before the hand-off left it in place, and the next
// attempt, finding it, handed nothing over: the rows were stranded.
func TestCreateSlotCrashBeforeTheSlotStrandsNothing(t *testing.T) {
	pgtest.Logical(t)
	pool, cfg := pgtest.Schema(t)
	cfg, err := cfg.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	slot, err := Slot{}.Resolve(context.Background(), pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = DropSlot(context.Background(), pool, cfg, slot) })
	ctx := context.Background()
	table := pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize()
	for range 3 {
		if _, err := pool.Exec(ctx, `INSERT INTO `+table+` (event_id, aggregate_id, type, payload) VALUES (gen_random_uuid(), $1, 'order.placed', '{}')`, uuid.NewString()); err != nil {
			t.Fatal(err)
		}
	}
	// Log-only events written while the slot is being made: each write
	// either fails in its transaction or is in the slot's stream.
	logWrite, err := cfg.LogWriteFunc()
	if err != nil {
		t.Fatal(err)
	}
	var accepted []string
	writeLogOnly := func() {
		marker := "marker-" + uuid.NewString()
		if _, err := pool.Exec(ctx, `SELECT `+logWrite+`($1)`, `{"v":1,"m":"`+marker+`"}`); err == nil {
			accepted = append(accepted, marker)
		}
	}
	crash := errors.New("killed")
	testHookHandedOff = func() error {
		// A row committed after the hand-off, still before the slot.
		if _, err := pool.Exec(ctx, `INSERT INTO `+table+` (event_id, aggregate_id, type, payload) VALUES (gen_random_uuid(), $1, 'order.placed', '{}')`, uuid.NewString()); err != nil {
			t.Fatal(err)
		}
		writeLogOnly()
		return crash
	}
	_, err = CreateSlot(ctx, pool, cfg, slot)
	testHookHandedOff = nil
	if !errors.Is(err, crash) {
		t.Fatalf("CreateSlot = %v, want the crash", err)
	}
	if st, err := Inspect(ctx, pool, cfg, slot); err != nil || st.Exists {
		t.Fatalf("slot exists after a crash before it was made (%v)", err)
	}
	testHookHandedOff = func() error { writeLogOnly(); return nil }
	c, err := CreateSlot(ctx, pool, cfg, slot)
	testHookHandedOff = nil
	if err != nil || !c.Slot || c.HandedOff != 1 {
		t.Fatalf("CreateSlot after the crash = %+v, %v; want the slot made and the one row left handed off", c, err)
	}
	writeLogOnly()
	if len(accepted) == 0 {
		t.Fatal("no log-only write accepted once the slot exists")
	}
	// The slot's stream, read without moving it, carries every accepted
	// write.
	var stream string
	err = pool.QueryRow(ctx, `SELECT COALESCE(string_agg(encode(data, 'escape'), ''), '')
FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL, 'proto_version', '1', 'publication_names', $2, 'messages', 'true')`,
		slot.Name, slot.Publication).Scan(&stream)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range accepted {
		if !strings.Contains(stream, m) {
			t.Errorf("log-only event %s was accepted during the slot's creation and is not in its stream: lost", m)
		}
	}
	var pending int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+table+` WHERE handoff_at IS NULL`).Scan(&pending); err != nil {
		t.Fatal(err)
	}
	if pending != 0 {
		t.Fatalf("%d rows neither handed off nor in the slot's stream", pending)
	}
	// The temporary slots go when their walsenders exit, a moment after
	// their connections close.
	deadline := time.Now().Add(10 * time.Second)
	for {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'outbox\_creating\_%'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d temporary slots left", n)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
