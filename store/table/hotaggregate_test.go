package table_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store/table"
)

// hangingPublisher hangs every publish of one aggregate (every publish
// when agg is empty) until released or timed out, and records when each
// other aggregate's first event went out.
type hangingPublisher struct {
	agg         string
	release     chan struct{}
	releaseOnce sync.Once

	mu   sync.Mutex
	sent map[string]time.Time // aggregate of each other event -> when
	seen chan struct{}        // a value per other event
}

func (p *hangingPublisher) Publish(ctx context.Context, e *core.Event) error {
	if p.agg == "" || e.AggregateID == p.agg {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-p.release:
			return errors.New("released unpublished")
		}
	}
	p.mu.Lock()
	if _, ok := p.sent[e.AggregateID]; !ok {
		p.sent[e.AggregateID] = time.Now()
		p.seen <- struct{}{}
	}
	p.mu.Unlock()
	return nil
}

func (p *hangingPublisher) Close() error { return nil }

// One aggregate holds a batch's worth and more of the oldest events and
// its every publish hangs, as on a broker partition without a leader: the
// other aggregates' events go out at once all the same, not after the
// publish timeout. The relay runs at its defaults but for the timeout.
func TestHangingAggregateHoldsBackOnlyItself(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	in := newInstance(t, pool, cfg)
	ctx := context.Background()
	const hot, others = "hot", 100
	var evs []core.Event
	for range 1000 {
		evs = append(evs, core.Event{AggregateID: hot, Type: "a.b", Payload: []byte(`{}`)})
	}
	for i := range others {
		evs = append(evs, core.Event{AggregateID: fmt.Sprintf("other-%d", i), Type: "a.b", Payload: []byte(`{}`)})
	}
	if err := in.Produce(ctx, evs, true); err != nil {
		t.Fatal(err)
	}
	pub := newHangingPublisher(hot, others)
	start := time.Now()
	runRelay(t, in.s, pub, core.Options{PublishTimeout: 10 * time.Second})
	timeout := time.After(15 * time.Second)
	for n := 0; n < others; n++ {
		select {
		case <-pub.seen:
		case <-timeout:
			t.Fatalf("%d of %d other aggregates' events published in 15s", n, others)
		}
	}
	last := time.Since(start)
	t.Logf("the %d other aggregates' events were all published %v after the relay started", others, last.Round(time.Millisecond))
	// The bound leaves a loaded machine room; the publish timeout is 10s.
	if last > time.Second {
		t.Fatalf("the other aggregates waited %v behind a hanging aggregate", last)
	}
}

func newHangingPublisher(agg string, others int) *hangingPublisher {
	return &hangingPublisher{agg: agg, release: make(chan struct{}), sent: map[string]time.Time{}, seen: make(chan struct{}, others)}
}

// runRelay runs a relay until the test ends, when pub's hanging publishes
// are released first.
func runRelay(t *testing.T, s core.Source, pub *hangingPublisher, opts core.Options) {
	t.Helper()
	r, err := core.New(s, pub, opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		pub.releaseOnce.Do(func() { close(pub.release) })
		cancel()
		if err := <-done; err != nil {
			t.Errorf("relay: %v", err)
		}
	})
}

// Two relays that do not share (DisableSharing, as behind a pooler in
// transaction mode) both claim from everything: while the first holds
// claims open, their publishes hanging, the second claims and publishes
// every event the first does not hold.
func TestUnsharedRelayClaimsBesideOpenClaims(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	in := newInstance(t, pool, cfg)
	ctx := context.Background()
	const total = 2000
	evs := make([]core.Event, total)
	for i := range evs {
		evs[i] = core.Event{AggregateID: fmt.Sprintf("agg-%d", i), Type: "a.b", Payload: []byte(`{}`)}
	}
	if err := in.Produce(ctx, evs, true); err != nil {
		t.Fatal(err)
	}
	first := newHangingPublisher("", 0)
	claimed := &claimSum{}
	runRelay(t, in.s, first, core.Options{DisableSharing: true, PublishTimeout: time.Minute, Observer: claimed})
	// The first relay claims until its queue is full, and then holds its
	// claims open.
	waitFor(t, "the first relay's claims", func() bool { return claimed.n.Load() >= 500 })
	held := int(claimed.n.Load())
	for {
		time.Sleep(100 * time.Millisecond)
		if n := int(claimed.n.Load()); n == held {
			break
		} else {
			held = n
		}
	}
	second, err := table.New(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	want := total - held
	pub := newHangingPublisher("no such aggregate", want) // hangs nothing
	start := time.Now()
	runRelay(t, second, pub, core.Options{DisableSharing: true})
	timeout := time.After(10 * time.Second)
	for n := 0; n < want; n++ {
		select {
		case <-pub.seen:
		case <-timeout:
			t.Fatalf("the second relay published %d of the %d events the first does not hold in 10s", n, want)
		}
	}
	took := time.Since(start)
	t.Logf("the second relay published the %d events the first does not hold in %v", want, took.Round(time.Millisecond))
	if took > 2*time.Second {
		t.Fatalf("the second relay took %v to publish the events the first does not hold", took)
	}
}

// claimSum is a core.Observer summing the events claimed.
type claimSum struct{ n atomic.Int64 }

func (c *claimSum) Claimed(n int, _ time.Duration)              { c.n.Add(int64(n)) }
func (c *claimSum) Published(*core.Event, time.Duration, error) {}
func (c *claimSum) Completed(int, int, time.Duration)           {}
func (c *claimSum) Errored(string, error)                       {}
func (*claimSum) Rejected(*core.Event, error)                   {}
