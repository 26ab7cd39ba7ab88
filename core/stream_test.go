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

// gatedStore holds every Complete until released, and counts claims and
// the claims made while an earlier one was still open.
type gatedStore struct {
	core.Source
	release    chan struct{}
	claims     atomic.Int64
	open       atomic.Int64
	overlapped atomic.Int64 // claims made while another was open
	inFlight   atomic.Int64 // claims that listed events in flight and got events
}

func (s *gatedStore) Claim(ctx context.Context, req core.ClaimOptions) (core.Claim, error) {
	c, err := s.Source.Claim(ctx, req)
	if err != nil {
		return nil, err
	}
	s.claims.Add(1)
	if len(c.Events()) == 0 {
		return c, nil
	}
	if s.open.Add(1) > 1 {
		s.overlapped.Add(1)
	}
	if len(req.InFlight) > 0 {
		s.inFlight.Add(1)
	}
	return &gatedClaim{Claim: c, s: s}, nil
}

type gatedClaim struct {
	core.Claim
	s *gatedStore
}

func (c *gatedClaim) Complete(ctx context.Context, done []int64, failed []core.Failure) error {
	if c.s.release != nil {
		select {
		case <-c.s.release:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	c.s.open.Add(-1)
	return c.Claim.Complete(ctx, done, failed)
}

// holding publishes into published, holding each event hold picks until
// release is closed.
func holding(published *log, release <-chan struct{}, hold func(*core.Event) bool) pubFunc {
	return func(ctx context.Context, e *core.Event) error {
		if hold(e) {
			select {
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		published.add(e)
		return nil
	}
}

// Publishing does not wait for the batch before it to be recorded: while
// the first claim's Complete is held, the next claims are made and their
// events published.
func TestPublishingDoesNotWaitForRecording(t *testing.T) {
	ms := memsource.New()
	for i := range 30 {
		ms.Add(core.Event{AggregateID: fmt.Sprintf("agg-%d", i)})
	}
	st := &gatedStore{Source: ms, release: make(chan struct{})}
	var published log
	pub := pubFunc(func(ctx context.Context, e *core.Event) error { published.add(e); return nil })
	startRelay(t, st, pub, core.Options{BatchSize: 10, Lanes: 4, Claimers: 3, PollInterval: time.Millisecond})
	waitFor(t, "three batches published while none is recorded", func() bool { return len(published.seqs()) == 30 })
	if n := st.overlapped.Load(); n < 2 {
		t.Fatalf("%d claims were made while another was open, want 2", n)
	}
	close(st.release)
	waitFor(t, "every batch to be recorded", drained(ms))
}

// The next batch is claimed while the lanes still publish the last one:
// no claim waits for its predecessor's slowest event.
func TestClaimsWhileLanesPublish(t *testing.T) {
	ms := memsource.New()
	for i := range 20 {
		ms.Add(core.Event{AggregateID: fmt.Sprintf("agg-%d", i)})
	}
	st := &gatedStore{Source: ms}
	first := ms.Pending()[0]
	slow := make(chan struct{})
	var published log
	pub := holding(&published, slow, func(e *core.Event) bool { return e.Seq == first })
	startRelay(t, st, pub, core.Options{BatchSize: 5, Lanes: 4, Claimers: 2, PollInterval: time.Millisecond})
	waitFor(t, "the second batch to be published while the first one's slow event is out", func() bool {
		return len(published.seqs()) >= 9
	})
	close(slow)
	waitFor(t, "every event to be published", drained(ms))
}

// One aggregate whose publish hangs holds back only itself: its later
// events, claimed into newer batches, are let go after a while so those
// batches can be recorded, and every other aggregate keeps flowing through
// far more batches than the relay keeps open.
func TestSlowAggregateHoldsBackOnlyItself(t *testing.T) {
	ms := memsource.New()
	var slowIDs []int64
	for i := range 200 {
		agg := fmt.Sprintf("agg-%d", i%10)
		if i%10 == 0 {
			agg = "slow"
		}
		seq := ms.Add(core.Event{AggregateID: agg})[0]
		if agg == "slow" {
			slowIDs = append(slowIDs, seq)
		}
	}
	st := &gatedStore{Source: ms}
	hang := make(chan struct{})
	var published log
	var slowOrder []int64
	var mu sync.Mutex
	pub := pubFunc(func(ctx context.Context, e *core.Event) error {
		if e.AggregateID == "slow" {
			if e.Seq == slowIDs[0] {
				select {
				case <-hang:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			mu.Lock()
			slowOrder = append(slowOrder, e.Seq)
			mu.Unlock()
		}
		published.add(e)
		return nil
	})
	startRelay(t, st, pub, core.Options{BatchSize: 10, Lanes: 4, Claimers: 3, PollInterval: time.Millisecond})
	others := func() int {
		n := 0
		for _, seq := range published.seqs() {
			if !slices.Contains(slowIDs, seq) {
				n++
			}
		}
		return n
	}
	waitFor(t, "every other aggregate to be published while one hangs", func() bool { return others() == 180 })
	for _, seq := range published.seqs() {
		if slices.Contains(slowIDs, seq) {
			t.Fatalf("event %d of the hanging aggregate was published before its first", seq)
		}
	}
	if st.inFlight.Load() == 0 {
		t.Fatal("no claim listed events in flight")
	}
	close(hang)
	waitFor(t, "every event to be published", drained(ms))
	mu.Lock()
	defer mu.Unlock()
	if !slices.IsSorted(slowOrder) || len(slices.Compact(slices.Clone(slowOrder))) != len(slowIDs) {
		t.Fatalf("the slow aggregate went out as %v, want each of %v once in order", slowOrder, slowIDs)
	}
}

// failStore makes the claim that lists the failing event in flight wait
// until that event's publish has failed and its batch is being recorded,
// so the claim takes the aggregate's next events on the strength of an
// event that has just failed.
type failStore struct {
	core.Source
	failing    int64
	claiming   chan struct{} // closed when a claim lists the failing event in flight
	failed     chan struct{} // closed by the publisher as it fails
	completing chan struct{} // closed when the failed event's batch is being recorded
	claimed    chan struct{} // closed once that claim has returned
	once       sync.Once
	completed  sync.Once
}

func (s *failStore) Claim(ctx context.Context, req core.ClaimOptions) (core.Claim, error) {
	if !slices.Contains(req.InFlight, s.failing) {
		return s.wrap(s.Source.Claim(ctx, req))
	}
	var c core.Claim
	var err error
	ran := false
	s.once.Do(func() {
		ran = true
		close(s.claiming)
		<-s.failed
		<-s.completing
		c, err = s.wrap(s.Source.Claim(ctx, req))
		close(s.claimed)
	})
	if !ran {
		return s.wrap(s.Source.Claim(ctx, req))
	}
	return c, err
}

func (s *failStore) wrap(c core.Claim, err error) (core.Claim, error) {
	if err != nil {
		return nil, err
	}
	for _, e := range c.Events() {
		if e.Seq == s.failing {
			return &failClaim{Claim: c, s: s}, nil
		}
	}
	return c, nil
}

type failClaim struct {
	core.Claim
	s *failStore
}

func (c *failClaim) Complete(ctx context.Context, done []int64, failed []core.Failure) error {
	c.s.completed.Do(func() {
		close(c.s.completing)
		<-c.s.claimed
	})
	return c.Claim.Complete(ctx, done, failed)
}

// A failure in one claim holds back the aggregate's later events that a
// newer claim took while the failed event was in flight: none passes the
// failed event, which is retried first.
func TestFailureHoldsLaterClaimsOfItsAggregate(t *testing.T) {
	ms := memsource.New()
	var seqs []int64
	for range 6 {
		seqs = append(seqs, ms.Add(core.Event{AggregateID: "x"})[0])
	}
	st := &failStore{Source: ms, failing: seqs[1], claiming: make(chan struct{}), failed: make(chan struct{}),
		completing: make(chan struct{}), claimed: make(chan struct{})}
	var failedOnce atomic.Bool
	var published log
	pub := pubFunc(func(ctx context.Context, e *core.Event) error {
		if e.Seq == st.failing && failedOnce.CompareAndSwap(false, true) {
			<-st.claiming // a claim counts this event in flight
			close(st.failed)
			return errors.New("broker timeout")
		}
		published.add(e)
		return nil
	})
	startRelay(t, st, pub, core.Options{BatchSize: 2, Lanes: 2, Claimers: 3, PollInterval: time.Millisecond,
		RetryBackoff: core.Backoff{Min: 50 * time.Millisecond, Max: 50 * time.Millisecond}})
	waitFor(t, "every event to be published", drained(ms))
	got := published.seqs()
	if !slices.IsSorted(got) {
		t.Fatalf("x went out as %v: a later event passed the failed one", got)
	}
	if !slices.Equal(slices.Compact(slices.Clone(got)), seqs) {
		t.Fatalf("published %v, want %v", got, seqs)
	}
}
