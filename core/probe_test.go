package core_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/memsource"
)

// pingPub is a publisher whose broker is up or down, and which answers
// pings accordingly.
type pingPub struct {
	up    atomic.Bool
	pings atomic.Int64
	sent  log
}

func (p *pingPub) Publish(ctx context.Context, e *core.Event) error {
	if !p.up.Load() {
		return errors.New("connection refused")
	}
	p.sent.add(e)
	return nil
}

func (p *pingPub) Ping(ctx context.Context) error {
	p.pings.Add(1)
	if !p.up.Load() {
		return errors.New("connection refused")
	}
	return nil
}

func (p *pingPub) Close() error { return nil }

// After an outage long enough to grow the error backoff, the relay
// publishes again within 2s of the broker answering, not after the backoff.
func TestResumesSoonAfterBrokerReturns(t *testing.T) {
	s := memsource.New()
	pub := &pingPub{}
	s.Add(core.Event{AggregateID: "a"})
	startRelay(t, s, pub, core.Options{
		PollInterval: 10 * time.Millisecond,
		RetryBackoff: core.Backoff{Min: time.Microsecond, Max: time.Microsecond},
		ErrorBackoff: core.Backoff{Min: 20 * time.Second, Max: 30 * time.Second},
	})
	waitFor(t, "a probe to fail", func() bool { return pub.pings.Load() > 0 })
	s.Add(core.Event{AggregateID: "b"})
	up := time.Now()
	pub.up.Store(true)
	deadline := up.Add(2 * time.Second)
	for len(s.Pending()) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d events still pending 2s after the broker came back", len(s.Pending()))
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Logf("publishing again %v after the broker answered", time.Since(up).Round(time.Millisecond))
}

// A batch that fails while every ping succeeds (the broker answers but
// refuses) keeps its whole backoff: probing must not make the loop spin.
func TestProbeKeepsBackoffWhileServersAnswer(t *testing.T) {
	s := memsource.New()
	s.Add(core.Event{AggregateID: "a"})
	cs := &countingStore{Source: s}
	pub := &refusing{}
	startRelay(t, cs, pub, core.Options{
		PollInterval: time.Millisecond, Claimers: 1, // one loop's backoff is counted
		ProbeInterval: time.Millisecond,
		RetryBackoff:  core.Backoff{Min: time.Microsecond, Max: time.Microsecond},
		ErrorBackoff:  core.Backoff{Min: 200 * time.Millisecond, Max: 400 * time.Millisecond},
	})
	waitFor(t, "the first failed batch", func() bool { return cs.claims.Load() > 0 })
	time.Sleep(time.Second)
	if n := cs.claims.Load(); n > 8 {
		t.Fatalf("%d claims in a second with backoffs of 200-400ms: probing shortened the backoff", n)
	}
	if pub.pings.Load() < 10 {
		t.Fatalf("%d pings: the relay did not probe while backing off", pub.pings.Load())
	}
}

// Events the broker reports undeliverable (no queue receives them) are
// retried on their own backoff; they do not back the loop off as from a
// broker that is down, so other events go out as they come.
func TestUndeliverableDoesNotBackOffTheLoop(t *testing.T) {
	s := memsource.New()
	unrouted := s.Add(core.Event{AggregateID: "unrouted"})[0]
	obs := &observer{}
	var sent log
	pub := pubFunc(func(ctx context.Context, e *core.Event) error {
		if e.AggregateID == "unrouted" {
			return core.Undeliverable(errors.New("returned: no queue is bound"))
		}
		sent.add(e)
		return nil
	})
	startRelay(t, s, pub, core.Options{
		PollInterval: 10 * time.Millisecond, Observer: obs,
		RetryBackoff: core.Backoff{Min: 20 * time.Second, Max: 30 * time.Second},
		ErrorBackoff: core.Backoff{Min: 20 * time.Second, Max: 30 * time.Second},
	})
	waitFor(t, "the undeliverable event's failure to be recorded", func() bool { return s.LastError(unrouted) != "" })
	seqs := s.Add(core.Event{AggregateID: "routed"})
	added := time.Now()
	for !sent.has(seqs[0]) {
		if time.Since(added) > 2*time.Second {
			t.Fatal("an event waited over 2s behind another's undeliverable failure")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if n := obs.published.Load(); n != 2 {
		t.Errorf("%d publish attempts, want 2: the undeliverable event's own backoff paces it", n)
	}
}

// refusing answers pings but fails every publish.
type refusing struct{ pings atomic.Int64 }

func (p *refusing) Publish(context.Context, *core.Event) error { return errors.New("nack") }
func (p *refusing) Ping(context.Context) error                 { p.pings.Add(1); return nil }
func (p *refusing) Close() error                               { return nil }

// pingStore is a store that can be pinged, down until up is set.
type pingStore struct {
	*memsource.Source
	up atomic.Bool
}

func (s *pingStore) Ping(context.Context) error {
	if !s.up.Load() {
		return errors.New("database is down")
	}
	return nil
}

// The store is probed too: the relay resumes soon after the database
// returns.
func TestResumesSoonAfterStoreReturns(t *testing.T) {
	ms := memsource.New()
	ms.SetClaimErr(errors.New("connection refused"))
	s := &pingStore{Source: ms}
	var published log
	pub := pubFunc(func(ctx context.Context, e *core.Event) error { published.add(e); return nil })
	startRelay(t, s, pub, core.Options{
		PollInterval: 10 * time.Millisecond,
		ErrorBackoff: core.Backoff{Min: 20 * time.Second, Max: 30 * time.Second},
	})
	time.Sleep(600 * time.Millisecond) // a failed claim and a failed probe or two
	ms.Add(core.Event{AggregateID: "a"})
	up := time.Now()
	ms.SetClaimErr(nil)
	s.up.Store(true)
	deadline := up.Add(2 * time.Second)
	for len(ms.Pending()) > 0 {
		if time.Now().After(deadline) {
			t.Fatal("event still pending 2s after the database came back")
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Logf("publishing again %v after the database answered", time.Since(up).Round(time.Millisecond))
}

// cannotPing is a publisher that takes everything and cannot ask its
// broker.
type cannotPing struct{ sent log }

func (p *cannotPing) Publish(ctx context.Context, e *core.Event) error { p.sent.add(e); return nil }
func (p *cannotPing) Ping(context.Context) error {
	return fmt.Errorf("no way to ask: %w", errors.ErrUnsupported)
}
func (p *cannotPing) Close() error { return nil }

// A Ping that cannot ask (errors.ErrUnsupported) is no check in Ready and
// does not hold the relay back as a failed probe would.
func TestPingUnsupportedIsNeitherUpNorDown(t *testing.T) {
	s := memsource.New()
	pub := &cannotPing{}
	r := startRelay(t, s, pub, core.Options{PollInterval: 10 * time.Millisecond})
	s.Add(core.Event{AggregateID: "a"})
	waitFor(t, "the event", func() bool { return len(s.Pending()) == 0 })
	for _, c := range r.Ready(context.Background()) {
		if c.Name == "publisher" {
			t.Errorf("Ready has a publisher check (%v) for a publisher that cannot be asked", c.Err)
		}
	}
}

// hangingPub is pingPub whose publishes of aggregate "slow" hang while the
// broker is down, until the connection they wait on breaks (broken).
type hangingPub struct {
	pingPub
	broken   chan struct{}
	slowDone chan struct{} // closed once the slow publish has failed
}

func (p *hangingPub) Publish(ctx context.Context, e *core.Event) error {
	if e.AggregateID == "slow" && !p.up.Load() {
		<-p.broken
		defer close(p.slowDone)
		return errors.New("connection reset")
	}
	return p.pingPub.Publish(ctx, e)
}

// A batch that fails in an outage, but whose failure is recorded only as
// the outage ends (a publish hung on a half-open connection until it
// broke), has been waited out already: once a probe sees the broker back,
// the relay resumes, and does not back off again for that batch.
func TestBatchFailedInTheOutageIsNotWaitedOutTwice(t *testing.T) {
	s := memsource.New()
	pub := &hangingPub{broken: make(chan struct{}), slowDone: make(chan struct{})}
	s.Add(core.Event{AggregateID: "slow"})
	startRelay(t, s, pub, core.Options{
		PollInterval:  10 * time.Millisecond,
		Claimers:      2,
		ProbeInterval: 20 * time.Millisecond,
		RetryBackoff:  core.Backoff{Min: time.Microsecond, Max: time.Microsecond},
		ErrorBackoff:  core.Backoff{Min: 20 * time.Second, Max: 30 * time.Second},
	})
	waitFor(t, "the slow publish to hang", func() bool { return len(s.Pending()) == 1 && pub.pings.Load() == 0 })
	time.Sleep(50 * time.Millisecond)
	s.Add(core.Event{AggregateID: "a"}) // fails at once: the loop backs off
	waitFor(t, "a probe to fail", func() bool { return pub.pings.Load() > 0 })
	close(pub.broken)
	<-pub.slowDone
	time.Sleep(20 * time.Millisecond)
	up := time.Now()
	pub.up.Store(true)
	s.Add(core.Event{AggregateID: "b"})
	deadline := up.Add(2 * time.Second)
	for len(s.Pending()) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d events still pending 2s after the broker came back", len(s.Pending()))
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Logf("publishing again %v after the broker answered", time.Since(up).Round(time.Millisecond))
}
