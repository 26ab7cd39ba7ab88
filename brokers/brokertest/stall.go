package brokertest

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/memsource"
)

// StallHarness connects the stall cases to one publisher whose every
// connection to its broker goes through a Proxy.
type StallHarness struct {
	// Open returns a publisher routing with r whose broker connections
	// all pass through the returned proxy. topics lists the topics the
	// case publishes to. The suite closes the publisher.
	Open func(t *testing.T, r *brokers.Routing, topics []string) (core.Publisher, *Proxy)
	// Modes are the proxy modes to try; default Stall, BlackHole and
	// HalfOpen.
	Modes []Mode
	// CloseTimeout is the publisher's bound on Close; default 3s.
	CloseTimeout time.Duration
}

// RunStalls checks that a publisher stays bounded whatever its broker
// does: a publish to a broker that does not answer returns by its
// deadline, Close returns while a publish is stuck, Ping reports the
// outage and its end, and a relay publishes again within 2s of the broker
// answering, however long its error backoff had grown.
func RunStalls(t *testing.T, h StallHarness) {
	t.Helper()
	if h.Open == nil {
		t.Fatal("brokertest: StallHarness needs Open")
	}
	if h.Modes == nil {
		h.Modes = []Mode{Stall, BlackHole, HalfOpen}
	}
	if h.CloseTimeout == 0 {
		h.CloseTimeout = 3 * time.Second
	}
	s := stalls{h: h}
	for _, m := range h.Modes {
		t.Run(m.String(), func(t *testing.T) {
			t.Run("PublishBounded", func(t *testing.T) { s.publishBounded(t, m) })
			t.Run("CloseWhilePublishStuck", func(t *testing.T) { s.closeWhileStuck(t, m) })
			t.Run("PingReportsOutage", func(t *testing.T) { s.ping(t, m) })
			t.Run("RelayResumesAfterHeal", func(t *testing.T) { s.relayResumes(t, m) })
		})
	}
}

type stalls struct{ h StallHarness }

func (s stalls) open(t *testing.T, topics ...string) (core.Publisher, *Proxy, string, func() error) {
	t.Helper()
	prefix := uniquePrefix()
	full := make([]string, len(topics))
	for i, tp := range topics {
		full[i] = prefix + tp
	}
	pub, proxy := s.h.Open(t, &brokers.Routing{TopicPrefix: prefix}, full)
	if pub == nil || proxy == nil {
		t.Fatal("brokertest: Open returned no publisher or no proxy")
	}
	closed := false
	closeOnce := func() error {
		if closed {
			return nil
		}
		closed = true
		return pub.Close()
	}
	t.Cleanup(func() {
		if err := closeOnce(); err != nil {
			t.Logf("close: %v", err)
		}
	})
	return pub, proxy, prefix, closeOnce
}

func publishWithin(pub core.Publisher, e *core.Event, d time.Duration) (time.Duration, error) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	start := time.Now()
	err := pub.Publish(ctx, e)
	return time.Since(start), err
}

func (s stalls) publishBounded(t *testing.T, m Mode) {
	pub, proxy, _, _ := s.open(t, "order")
	if _, err := publishWithin(pub, newEvent(1, "s", "order.placed", `{}`, nil), 20*time.Second); err != nil {
		t.Fatalf("publish before the fault: %v", err)
	}
	proxy.SetMode(m)
	for i := range 3 { // the wedged connection, then the reconnects
		took, err := publishWithin(pub, newEvent(int64(2+i), "s", "order.placed", `{}`, nil), time.Second)
		if err == nil {
			t.Fatalf("publish %d through a %v proxy succeeded", i, m)
		}
		if took > 1500*time.Millisecond {
			t.Fatalf("publish %d through a %v proxy returned after %v with a 1s deadline: %v", i, m, took, err)
		}
		t.Logf("publish %d failed after %v: %v", i, took.Round(time.Millisecond), err)
	}
	proxy.Heal()
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := publishWithin(pub, newEvent(9, "s", "order.placed", `{}`, nil), 2*time.Second)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no publish succeeded within 10s of the heal: %v", err)
		}
	}
}

func (s stalls) closeWhileStuck(t *testing.T, m Mode) {
	pub, proxy, _, closePub := s.open(t, "order")
	if _, err := publishWithin(pub, newEvent(1, "c", "order.placed", `{}`, nil), 20*time.Second); err != nil {
		t.Fatalf("publish before the fault: %v", err)
	}
	proxy.SetMode(m)
	published := make(chan error, 1)
	go func() { published <- pub.Publish(context.Background(), newEvent(2, "c", "order.placed", `{}`, nil)) }()
	time.Sleep(200 * time.Millisecond) // let it get stuck
	start := time.Now()
	err := closePub()
	took := time.Since(start)
	t.Logf("Close returned after %v: %v", took.Round(time.Millisecond), err)
	if limit := s.h.CloseTimeout + time.Second; took > limit {
		t.Fatalf("Close took %v while a publish was stuck, want at most %v", took, limit)
	}
	select {
	case err := <-published:
		t.Logf("the stuck publish returned: %v", err)
	case <-time.After(5 * time.Second):
		t.Fatal("the stuck publish did not return after Close")
	}
}

func (s stalls) ping(t *testing.T, m Mode) {
	pub, proxy, _, _ := s.open(t, "order")
	p, ok := pub.(core.Pinger)
	if !ok {
		t.Fatal("the publisher does not implement core.Pinger")
	}
	pingWithin := func(d time.Duration) (time.Duration, error) {
		ctx, cancel := context.WithTimeout(context.Background(), d)
		defer cancel()
		start := time.Now()
		err := p.Ping(ctx)
		return time.Since(start), err
	}
	if _, err := pingWithin(10 * time.Second); err != nil {
		t.Fatalf("ping of a healthy broker: %v", err)
	}
	proxy.SetMode(m)
	took, err := pingWithin(time.Second)
	if err == nil {
		t.Fatalf("ping through a %v proxy succeeded", m)
	}
	if took > 1500*time.Millisecond {
		t.Fatalf("ping returned after %v with a 1s deadline", took)
	}
	proxy.Heal()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err = pingWithin(2 * time.Second); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("ping still failing 10s after the heal: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// relayResumes runs a relay over a backlog, stalls the broker until the
// relay has failed a batch and backed off, heals, and wants publishing
// again within 2s.
func (s stalls) relayResumes(t *testing.T, m Mode) {
	pub, proxy, _, _ := s.open(t, "order")
	store := memsource.New()
	add := func(n int) {
		for i := range n {
			store.Add(core.Event{ID: fmt.Sprintf("00000000-0000-4000-8000-%012d", time.Now().UnixNano()%1e12+int64(i)),
				AggregateID: fmt.Sprintf("agg-%d", i%10), Type: "order.placed", Payload: []byte(`{}`)})
		}
	}
	add(20)
	obs := &countPublished{}
	pinger, ok := pub.(core.Pinger)
	if !ok {
		t.Fatal("the publisher does not implement core.Pinger")
	}
	probed := &countPings{Publisher: pub, p: pinger, t: t}
	relay, err := core.New(store, probed, core.Options{
		Logger: Logger(t),
		Lanes:  4, BatchSize: 50, PollInterval: 20 * time.Millisecond,
		PublishTimeout: time.Second, ShutdownTimeout: 2 * time.Second,
		RetryBackoff: core.Backoff{Min: time.Millisecond, Max: 10 * time.Millisecond},
		// Long enough that only probing can bring the relay back in time.
		ErrorBackoff: core.Backoff{Min: 10 * time.Second, Max: 30 * time.Second},
		Observer:     obs,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- relay.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-ran; err != nil {
			t.Errorf("relay: %v", err)
		}
	}()
	waitUntil(t, 20*time.Second, "the first events to go out", func() bool { return len(store.Pending()) == 0 })
	proxy.SetMode(m)
	add(20)
	waitUntil(t, 20*time.Second, "a failed publish", func() bool { return obs.failed.Load() > 0 })
	// The batch fails; the relay backs off and its probes fail.
	waitUntil(t, 20*time.Second, "a failed probe", func() bool { return probed.failed.Load() > 0 })
	before := obs.ok.Load()
	healed := time.Now()
	t.Logf("healing the proxy")
	proxy.Heal()
	waitUntil(t, 10*time.Second, "a publish after the heal", func() bool { return obs.ok.Load() > before })
	took := time.Since(healed)
	t.Logf("publishing again %v after the heal", took.Round(time.Millisecond))
	if took > 2*time.Second {
		t.Fatalf("first publish %v after the heal, want within 2s", took)
	}
	waitUntil(t, 20*time.Second, "the backlog to drain", func() bool { return len(store.Pending()) == 0 })
}

func waitUntil(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// countPublished counts publish outcomes.
type countPublished struct{ ok, failed atomic.Int64 }

func (c *countPublished) Claimed(int, time.Duration) {}
func (c *countPublished) Published(_ *core.Event, _ time.Duration, err error) {
	if err != nil {
		c.failed.Add(1)
	} else {
		c.ok.Add(1)
	}
}
func (c *countPublished) Completed(int, int, time.Duration) {}
func (c *countPublished) Errored(string, error)             {}
func (c *countPublished) Rejected(*core.Event, error)       {}

// countPings counts the relay's failed probes of the publisher, and logs
// each probe's outcome: what a case that fails has to show.
type countPings struct {
	core.Publisher
	p      core.Pinger
	t      *testing.T
	failed atomic.Int64
}

func (c *countPings) Ping(ctx context.Context) error {
	start := time.Now()
	err := c.p.Ping(ctx)
	if err != nil {
		c.failed.Add(1)
	}
	c.t.Logf("probe: %v after %v", err, time.Since(start).Round(time.Millisecond))
	return err
}
