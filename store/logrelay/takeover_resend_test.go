package logrelay_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/outboxhq/outbox/core"
)

// stalling publishes through a recorder, except the events of aggregate
// slow while held: their publish waits for its context to end.
type stalling struct {
	*recorder
	slow    string
	held    atomic.Bool
	stalled atomic.Int32 // publishes of slow that waited
}

func (p *stalling) Publish(ctx context.Context, e *core.Event) error {
	if e.AggregateID == p.slow && p.held.Load() {
		p.stalled.Add(1)
		<-ctx.Done()
		return ctx.Err()
	}
	return p.recorder.Publish(ctx, e)
}

// A kill re-sends no row published and recorded well before it. The slot's
// position can confirm nothing past an event still in flight, here a
// publish that hangs, however many events behind it went out: the rows
// that did are marked dispatched, and the session that reads them again
// after the kill (the replication connection dropped from the server's
// side, as when the relay's process dies) finds them so and leaves them
// out. It used to publish every one of them again.
func TestKillResendsNoRowPublishedBefore(t *testing.T) {
	e := newEnv(t)
	e.createSlot()
	slow := uuid.NewString()
	pub := &stalling{recorder: &recorder{}, slow: slow}
	pub.held.Store(true)
	o := e.opts()
	o.PublishTimeout = time.Minute // the stuck publish lasts until the kill
	r := e.start(pub, o)
	waitFor(t, 10*time.Second, "the relay to hold the slot", r.r.Holding)

	stuck := e.write(true, slow, 0, 1)[0]
	// Published alone, so the events behind it are marked as they go.
	waitFor(t, 10*time.Second, "the stuck event's publish", func() bool { return pub.stalled.Load() > 0 })
	const n = 100
	var sent []string
	for i := range n / 10 {
		sent = append(sent, e.write(true, fmt.Sprintf("agg-%d", i), 0, 10)...)
	}
	waitFor(t, 20*time.Second, "the events behind the stuck one published and marked", func() bool {
		got := pub.distinct()
		for _, id := range sent {
			if got[id] == 0 {
				return false
			}
		}
		return e.count("dispatched_at IS NOT NULL") == n
	})
	// Long enough for any confirmation to be sent: what the kill re-sends
	// is then what the relay could not confirm.
	time.Sleep(700 * time.Millisecond)
	if got := pub.distinct()[stuck]; got != 0 {
		t.Fatalf("the stuck event was published %d times before the kill", got)
	}
	before := len(pub.events())

	if _, err := e.pool.Exec(context.Background(),
		"SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1 AND active", e.slot.Name); err != nil {
		t.Fatal(err)
	}
	pub.held.Store(false)
	last := e.write(true, uuid.NewString(), 0, 1)[0]
	waitFor(t, 30*time.Second, "the stuck event and one written after the kill", func() bool {
		got := pub.distinct()
		return got[stuck] == 1 && got[last] == 1
	})
	again := map[string]bool{}
	for _, ev := range pub.events()[before:] {
		again[ev.ID] = true
	}
	resent := 0
	for _, id := range sent {
		if again[id] {
			resent++
		}
	}
	if resent > 0 {
		t.Fatalf("%d of %d rows published and marked before the kill were published again after it", resent, n)
	}
}
