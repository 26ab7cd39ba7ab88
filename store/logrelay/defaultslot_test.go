package logrelay_test

import (
	"sync"
	"testing"
	"time"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store/logrelay"
)

// A relay given no slot name (the default, as the package example runs
// it) reads the slot the name resolves to, and hands events to the table
// under that name too: the hand-off checks that this session holds the
// slot, and a check against the unresolved, empty name refused every
// hand-off, so a scheduled or failing event stalled its lane for good.
// Here a scheduled row and a scheduled log-only message, each due in a
// second, reach the table and are published from there after their
// deliver_at; 20 s bounds a second's wait and the table path's 50 ms
// polls on a loaded machine.
func TestDefaultSlotNameHandsOff(t *testing.T) {
	for _, fl := range flavours {
		t.Run(fl.name, func(t *testing.T) {
			e := newEnv(t)
			var mu sync.Mutex
			var published time.Time
			pub := &recorder{fail: func(*core.Event) error {
				mu.Lock()
				defer mu.Unlock()
				if published.IsZero() {
					published = time.Now()
				}
				return nil
			}}
			o := e.opts()
			o.Slot = logrelay.Slot{}
			run := e.startPair(pub, o)
			waitFor(t, 20*time.Second, "the relay to hold its slot", run.r.Holding)

			due := time.Now().Add(time.Second).Truncate(time.Microsecond)
			e.writeMsgs(fl.table, outbox.Message{AggregateID: "a", Type: "reminder.due", Payload: []byte(`{"n":1}`), DeliverAt: due})
			waitFor(t, 20*time.Second, "the scheduled event in the table", func() bool {
				return e.count("handoff_at IS NOT NULL") == 1
			})
			waitFor(t, 20*time.Second, "the scheduled event published", func() bool { return len(pub.events()) == 1 })
			mu.Lock()
			defer mu.Unlock()
			if published.Before(due) {
				t.Fatalf("published %s before its deliver_at", due.Sub(published))
			}
		})
	}
}
