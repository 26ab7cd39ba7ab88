package logrelay_test

import (
	"context"
	"testing"

	"github.com/outboxhq/outbox/store/logrelay"
)

// A recorded position belongs to the slot it was confirmed on. A record
// left of a slot of the same name that no longer exists (dropped by other
// means, or copied with the table from another cluster) must not move a
// new slot's start past transactions it has not read: `slot create`
// forgets it, and a position past the server's WAL is no position.
func TestStalePositionIsNotResumedFrom(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	lt, err := logrelay.NewLogTable(e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := lt.RecordSlot(ctx, e.pool, e.slot.Name, e.slot.Publication); err != nil {
		t.Fatal(err)
	}
	if err := lt.RecordPosition(ctx, e.pool, e.slot.Name, "0/1"); err != nil {
		t.Fatal(err)
	}
	e.createSlot()
	if pos, err := lt.Position(ctx, e.pool, e.slot.Name); err != nil || pos != "" {
		t.Fatalf("position after the slot was created anew = %q, %v; want none", pos, err)
	}
	// As from another cluster whose WAL had gone further.
	if err := lt.RecordPosition(ctx, e.pool, e.slot.Name, "FFFF/0"); err != nil {
		t.Fatal(err)
	}
	if pos, err := lt.Position(ctx, e.pool, e.slot.Name); err != nil || pos != "" {
		t.Fatalf("position past the server's WAL = %q, %v; want none", pos, err)
	}
}
