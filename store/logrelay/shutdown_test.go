package logrelay_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/wm"
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
	pub := &slowPublisher{d: 500 * time.Millisecond}
	o := e.opts()
	o.StatusInterval = time.Second
	o.ReceiveTimeout = 3 * time.Second
	// Each aggregate takes 2.5 s to publish, past the server's 2 s
	// wal_sender_timeout, with an event done every 0.5 s: a drain that
	// let events finishing put off its statuses lost its session (and its
	// last confirmation) to the timeout.
	o.WALSenderTimeout = 2 * time.Second
	// The shipped bound, not the harness's 5 s: the drain ends as soon as
	// the events are published and their rows marked, but under make test
	// the shared server can take seconds for a mark, and a drain cut short
	// confirms only what was done.
	o.ShutdownTimeout = 30 * time.Second
	first := e.start(pub, o)
	waitFor(t, 10*time.Second, "the relay to hold the slot", first.r.Holding)
	e.write(true, uuid.NewString(), 0, 5)
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

// A broker that takes nothing, behind a publisher that cannot ask it
// (wm.New without WithPing), is an outage: the failing events stay in
// place, holding the slot's position, and nothing is moved to the table.
// wm.New's Ping used to answer nil, so the relay read the outage as "the
// broker answers" and handed every event over after HandOffAfter tries.
func TestOutageBehindPublisherThatCannotPing(t *testing.T) {
	e := newEnv(t)
	e.createSlot()
	o := e.opts()
	o.HandOffAfter = 3
	r := e.startPair(wm.New(refusing{}, &brokers.Routing{Fixed: "t"}, nil), o)
	waitFor(t, 10*time.Second, "the relay to hold the slot", r.r.Holding)
	e.write(true, uuid.NewString(), 0, 3)
	e.write(false, uuid.NewString(), 0, 3)
	// RetryBackoff 5ms doubling to 50ms: 2s is well past 3 attempts each.
	time.Sleep(2 * time.Second)
	if n := e.count("handoff_at IS NOT NULL"); n != 0 {
		t.Fatalf("%d events handed to the table during a broker outage", n)
	}
	if n := r.r.InFlight(); n != 6 {
		t.Fatalf("%d events in flight, want the 6 written, held in place", n)
	}
}

type refusing struct{}

func (refusing) Publish(string, ...*message.Message) error { return errors.New("connection refused") }
func (refusing) Close() error                              { return nil }
