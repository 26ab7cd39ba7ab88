package walrelay_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/outboxhq/outbox/core"
)

// slowPublisher records, taking d per event.
type slowPublisher struct {
	recorder
	d time.Duration
}

func (p *slowPublisher) Publish(ctx context.Context, e *core.Event) error {
	if !sleepCtx(ctx, p.d) {
		return ctx.Err()
	}
	return p.recorder.Publish(ctx, e)
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// A stop (SIGTERM: Run's context cancelled) while the reader waits for the
// server lets the events in flight finish and confirms them, as the
// documentation of Run promises: a relay started after it republishes
// nothing. The reader waits in receive nearly all the time here (a status
// interval of 1s, every event read at once), which is where the stop used
// to return at once and leave the events to be republished.
func TestStopWhileReceivingDrainsAndConfirms(t *testing.T) {
	e := newEnv(t)
	e.createSlot()
	pub := &slowPublisher{d: 200 * time.Millisecond}
	o := e.opts()
	o.StatusInterval = time.Second
	o.ReceiveTimeout = 3 * time.Second
	first := e.start(pub, o)
	waitFor(t, 10*time.Second, "the relay to hold the slot", first.r.Holding)
	e.write(true, uuid.NewString(), 0, 5) // one aggregate: 1s of publishing
	e.write(false, uuid.NewString(), 0, 5)
	waitFor(t, 10*time.Second, "a first publish", func() bool { return len(pub.events()) > 0 })
	first.stop(t)
	if got := len(pub.distinct()); got != 10 {
		t.Fatalf("%d of 10 events published before Run returned, want all (drained)", got)
	}

	again := &recorder{}
	second := e.start(again, e.opts())
	waitFor(t, 10*time.Second, "the second relay to hold the slot", second.r.Holding)
	time.Sleep(time.Second)
	if n := len(again.events()); n != 0 {
		t.Errorf("the next relay republished %d events: the stop confirmed nothing", n)
	}
}
