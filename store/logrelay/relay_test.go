package logrelay_test

import (
	"testing"
	"time"

	"github.com/google/uuid"
)

// Both flavours go through one relay: rows of the table and log-only
// messages, in commit order per aggregate, payloads byte for byte, rows
// marked dispatched, and the slot confirmed past them.
func TestRelaysRowsAndMessages(t *testing.T) {
	e := newEnv(t)
	e.createSlot()
	pub := &recorder{}
	e.start(pub, e.opts())
	agg := uuid.NewString()
	var ids []string
	for i := range 20 {
		ids = append(ids, e.write(i%2 == 0, agg, 3*i, 3)...)
	}
	waitFor(t, 20*time.Second, "60 events", func() bool { return len(pub.distinct()) == 60 })
	got := pub.events()
	for i, ev := range got[:60] {
		if ev.ID != ids[i] || n(ev) != i {
			t.Fatalf("event %d: id %s n %d, want %s n %d", i, ev.ID, n(ev), ids[i], i)
		}
	}
	waitFor(t, 10*time.Second, "rows marked", func() bool { return e.count("dispatched_at IS NULL") == 0 })
	if c := e.count("true"); c != 30 {
		t.Errorf("table has %d rows, want the 30 written as rows", c)
	}
	waitFor(t, 10*time.Second, "slot confirmed", func() bool { return e.status().LagBytes < 1<<16 })
}
