package core_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/memsource"
)

// stream is a source like a replication stream: each event is given out
// once, and what the relay does not publish it must hand off. Handed-off
// aggregates stay handed off, so their later events follow.
type stream struct {
	mu      sync.Mutex
	events  []core.Event // not yet claimed
	offered []int64      // seqs the relay handed off, in order
	failed  map[int64]core.Failure
	off     map[string]bool
	done    []int64
}

func newStream(evs ...core.Event) *stream {
	return &stream{events: evs, failed: map[int64]core.Failure{}, off: map[string]bool{}}
}

func (s *stream) Claim(_ context.Context, req core.ClaimOptions) (core.Claim, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := min(req.Limit, len(s.events))
	c := &streamClaim{s: s, events: slices.Clone(s.events[:n])}
	s.events = s.events[n:]
	return c, nil
}

func (s *stream) handedOff() ([]int64, map[int64]core.Failure) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.offered), s.failed
}

type streamClaim struct {
	s      *stream
	events []core.Event
}

func (c *streamClaim) Events() []core.Event { return c.events }

func (c *streamClaim) Complete(_ context.Context, done []int64, failed []core.Failure) error {
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	if len(failed) > 0 {
		return errors.New("a hand-off claim got failures")
	}
	c.s.done = append(c.s.done, done...)
	return nil
}

func (c *streamClaim) Release(context.Context) error { return nil }

func (c *streamClaim) MustHandOff(_ context.Context, e *core.Event) (bool, error) {
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	return c.s.off[e.AggregateID], nil
}

func (c *streamClaim) HandOff(_ context.Context, e *core.Event, f *core.Failure) error {
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	c.s.offered = append(c.s.offered, e.Seq)
	if f != nil {
		c.s.failed[e.Seq] = *f
	}
	c.s.off[e.AggregateID] = true
	return nil
}

func streamEvents(aggs ...string) []core.Event {
	out := make([]core.Event, len(aggs))
	for i, a := range aggs {
		out[i] = core.Event{Seq: int64(i + 1), AggregateID: a}
	}
	return out
}

var fastRetry = core.Backoff{Min: time.Millisecond, Max: 5 * time.Millisecond}

// A claim that cannot offer an event again keeps a failing event in
// place while nothing else is published (an outage), and hands it off
// after HandOffAfter failures once others are published: its aggregate's
// later events follow it, in order; a permanent failure goes at once,
// held; other aggregates are published.
func TestHandOffKeepsOrderAndTellsOutageFromBadEvent(t *testing.T) {
	// a1 fails transiently until a2 is out; b1 fails permanently.
	s := newStream(streamEvents("a", "a", "a", "b", "b", "c")...)
	var calls atomic.Int64
	var out log
	pub := pubFunc(func(_ context.Context, e *core.Event) error {
		calls.Add(1)
		switch e.Seq {
		case 1:
			return errors.New("flaky")
		case 4:
			return core.Permanent(errors.New("too large"))
		}
		out.add(e)
		return nil
	})
	startRelay(t, s, pub, core.Options{BatchSize: 10, HandOffAfter: 3, RetryBackoff: fastRetry, PollInterval: 10 * time.Millisecond})
	waitFor(t, "five hand-offs", func() bool { off, _ := s.handedOff(); return len(off) == 5 })
	off, failed := s.handedOff()
	if want := []int64{1, 2, 3, 4, 5}; !slices.Equal(sorted(off), want) {
		t.Fatalf("handed off %v, want %v", off, want)
	}
	if a := slices.DeleteFunc(slices.Clone(off), func(seq int64) bool { return seq > 3 }); !slices.Equal(a, []int64{1, 2, 3}) {
		t.Errorf("aggregate a handed off in order %v, want [1 2 3]", a)
	}
	if f := failed[1]; f.RetryAt.IsZero() || f.Reason == "" {
		t.Errorf("transient failure handed off as %+v, want a reason and a retry time", f)
	}
	if f := failed[4]; !f.RetryAt.IsZero() || f.Reason == "" {
		t.Errorf("permanent failure handed off as %+v, want held with a reason", f)
	}
	if _, ok := failed[2]; ok {
		t.Errorf("event 2, only behind a failed one, handed off with a failure")
	}
	if got := out.seqs(); !slices.Equal(got, []int64{6}) {
		t.Errorf("published %v, want [6]", got)
	}
}

// With every publish failing and no other event going out, the failing
// event is a sign of an outage: it stays in place, retried, and is
// published once the broker is back, never handed off.
func TestOutageKeepsEventsInPlace(t *testing.T) {
	s := newStream(streamEvents("a", "a", "b")...)
	var down atomic.Bool
	down.Store(true)
	var attempts atomic.Int64
	var out log
	pub := pubFunc(func(_ context.Context, e *core.Event) error {
		attempts.Add(1)
		if down.Load() {
			return errors.New("connection refused")
		}
		out.add(e)
		return nil
	})
	startRelay(t, s, pub, core.Options{BatchSize: 10, HandOffAfter: 2, RetryBackoff: fastRetry, PollInterval: 10 * time.Millisecond})
	waitFor(t, "retries during the outage", func() bool { return attempts.Load() > 20 })
	down.Store(false)
	waitFor(t, "every event once the broker is back", func() bool { return len(out.seqs()) == 3 })
	if off, _ := s.handedOff(); len(off) > 0 {
		t.Errorf("handed off %v during an outage", off)
	}
	if got := out.seqs(); slices.Index(got, 1) > slices.Index(got, 2) {
		t.Errorf("published %v: a's events out of order", got)
	}
}

// A graceful stop finishes the queued events of a claim that cannot offer
// them again, instead of leaving them pending.
func TestStopFinishesEventsThatCannotBeOfferedAgain(t *testing.T) {
	s := newStream(streamEvents("a", "a", "a", "a")...)
	started := make(chan struct{}, 4)
	var out log
	pub := pubFunc(func(_ context.Context, e *core.Event) error {
		started <- struct{}{}
		time.Sleep(20 * time.Millisecond)
		out.add(e)
		return nil
	})
	r, err := core.New(s, pub, core.Options{BatchSize: 10, PollInterval: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	<-started
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := r.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if got := out.seqs(); !slices.Equal(got, []int64{1, 2, 3, 4}) {
		t.Errorf("published %v by the end of a graceful stop, want all four in order", got)
	}
}

func sorted(s []int64) []int64 {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}

// sleepyStore is a store whose producers wake the relay only while it
// sleeps; a producer commits silently just as the relay goes to sleep.
type sleepyStore struct {
	*memsource.Source
	mu       sync.Mutex
	sleeps   int
	awakes   int
	asleep   bool
	notifies int
	wake     func()
	silent   func()
}

func (s *sleepyStore) Listen(ctx context.Context, wake func()) error {
	s.mu.Lock()
	s.wake = wake
	s.mu.Unlock()
	<-ctx.Done()
	return nil
}

// write adds an event as a producer does: it wakes the relay only while
// the relay sleeps.
func (s *sleepyStore) write(e core.Event) {
	s.Add(e)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.asleep && s.wake != nil {
		s.notifies++
		s.wake()
	}
}

func (s *sleepyStore) Sleep(context.Context) (bool, error) {
	s.mu.Lock()
	s.sleeps++
	s.asleep = true
	f := s.silent
	s.silent = nil
	s.mu.Unlock()
	if f != nil {
		f()
	}
	return true, nil
}

func (s *sleepyStore) Awake(context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.awakes++
	s.asleep = false
	return nil
}

// A relay about to wait for a wake-up says so (core.Sleeper), then claims
// once more: an event that committed without waking it goes out at once,
// not at the next poll. Woken to a full batch, it ends the sleep.
func TestSleepThenClaimOnceMore(t *testing.T) {
	s := &sleepyStore{Source: memsource.New()}
	s.silent = func() { s.Add(core.Event{ID: "silent", AggregateID: "a", Type: "t"}) }
	var out log
	pub := pubFunc(func(_ context.Context, e *core.Event) error { out.add(e); return nil })
	r := startRelay(t, s, pub, core.Options{PollInterval: time.Hour, BatchSize: 2})
	waitFor(t, "the silent event", func() bool { return len(out.seqs()) == 1 })
	s.Add(core.Event{ID: "woken", AggregateID: "a", Type: "t"})
	s.Add(core.Event{ID: "woken2", AggregateID: "b", Type: "t"})
	r.Wake()
	waitFor(t, "the events after a wake-up", func() bool { return len(out.seqs()) == 3 })
	waitFor(t, "the sleep to end on waking and begin again", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.awakes >= 1 && s.sleeps >= 2
	})
}

// A relay woken for events that are not its own (another relay's, or
// none) stays asleep, so that its wake-ups do not pass the store's lock
// around; so it does when woken to a trickle's one event, which it claims
// without a claim after it and another after a new sleep.
func TestEmptyWakeupsKeepTheSleep(t *testing.T) {
	s := &sleepyStore{Source: memsource.New()}
	var out log
	pub := pubFunc(func(_ context.Context, e *core.Event) error { out.add(e); return nil })
	r := startRelay(t, s, pub, core.Options{PollInterval: time.Hour})
	waitFor(t, "the sleep", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.sleeps == 1
	})
	for range 20 {
		r.Wake()
		time.Sleep(2 * time.Millisecond)
	}
	s.write(core.Event{ID: "mine", AggregateID: "a", Type: "t"})
	waitFor(t, "the event", func() bool { return len(out.seqs()) == 1 })
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.awakes != 0 || s.sleeps != 1 {
		t.Errorf("over 20 empty wake-ups and one event the relay ended its sleep %d times and slept %d times, want 0 and 1", s.awakes, s.sleeps)
	}
}

// oneAtATime gives out one event per claim, as a stream read while the
// relay claims does under load.
type oneAtATime struct{ *stream }

func (s oneAtATime) Claim(ctx context.Context, req core.ClaimOptions) (core.Claim, error) {
	req.Limit = 1
	return s.stream.Claim(ctx, req)
}

// Claims that hand off hold nothing open: a failing aggregate whose later
// events fill more claims than Claimers must not stop the relay claiming
// other aggregates' events, whose publishes show the broker works and so
// let the failing event be handed off.
func TestHandOffClaimsDoNotHoldClaimingBack(t *testing.T) {
	s := newStream(streamEvents("a", "a", "a", "a", "a", "a")...)
	var out log
	pub := pubFunc(func(_ context.Context, e *core.Event) error {
		if e.Seq == 1 {
			return errors.New("flaky")
		}
		out.add(e)
		return nil
	})
	startRelay(t, oneAtATime{s}, pub, core.Options{Claimers: 2, HandOffAfter: 2, RetryBackoff: fastRetry, PollInterval: 10 * time.Millisecond})
	time.Sleep(100 * time.Millisecond) // a's events fill the claims
	s.mu.Lock()
	for i := range 3 {
		s.events = append(s.events, core.Event{Seq: int64(100 + i), AggregateID: "b"})
	}
	s.mu.Unlock()
	waitFor(t, "b's events published, and a's handed off after them", func() bool {
		off, _ := s.handedOff()
		return len(off) == 6 && len(out.seqs()) == 3
	})
	if got := out.seqs(); !slices.Equal(got, []int64{100, 101, 102}) {
		t.Errorf("published %v, want b's three events", got)
	}
}

// A relay whose claims keep finding events claims again shortly instead of
// sleeping: producers then have no relay to wake, and send no wake-ups.
func TestSteadyTrafficSendsFewWakeups(t *testing.T) {
	s := &sleepyStore{Source: memsource.New()}
	var out log
	pub := pubFunc(func(_ context.Context, e *core.Event) error { out.add(e); return nil })
	startRelay(t, s, pub, core.Options{PollInterval: time.Second})
	const events = 300
	for i := range events {
		s.write(core.Event{ID: fmt.Sprint(i), AggregateID: "a", Type: "t"})
		time.Sleep(time.Millisecond)
	}
	waitFor(t, "every event", func() bool { return len(out.seqs()) == events })
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.notifies > events/4 {
		t.Errorf("producers woke the relay %d times over %d events arriving one a millisecond, want few", s.notifies, events)
	}
}

// committer is a publisher that remembers events in the broker already.
type committer struct {
	pubFunc
	sent map[int64]bool
}

func (c committer) Sent(_ context.Context, e *core.Event) (bool, error) { return c.sent[e.Seq], nil }

// An event read again that the publisher says is in the broker already
// counts as published: it is not handed off, even behind a handed-off
// event of its aggregate, so it is not published a second time.
func TestCommittedEventIsNotHandedOff(t *testing.T) {
	s := newStream(streamEvents("a", "a", "b")...)
	s.off["a"] = true // an earlier event of a waits in the hand-off place
	var out log
	pub := committer{pubFunc: func(_ context.Context, e *core.Event) error { out.add(e); return nil }, sent: map[int64]bool{1: true}}
	startRelay(t, s, pub, core.Options{BatchSize: 10, RetryBackoff: fastRetry, PollInterval: 10 * time.Millisecond})
	waitFor(t, "all three resolved", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return len(s.done)+len(s.offered) == 3
	})
	off, _ := s.handedOff()
	if !slices.Equal(off, []int64{2}) {
		t.Errorf("handed off %v, want [2]: event 1 is in the broker already", off)
	}
	s.mu.Lock()
	done := slices.Clone(s.done)
	s.mu.Unlock()
	if !slices.Equal(sorted(done), []int64{1, 3}) {
		t.Errorf("recorded published %v, want [1 3]", done)
	}
	if got := out.seqs(); !slices.Equal(got, []int64{3}) {
		t.Errorf("sent %v, want [3]: event 1 must not be sent again", got)
	}
}
