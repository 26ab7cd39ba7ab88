package store_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store/pgtest"
)

// hangingPublisher hangs every publish of one aggregate until released or
// timed out, and records when each other event went out.
type hangingPublisher struct {
	agg     string
	release chan struct{}

	mu   sync.Mutex
	sent map[string]time.Time // aggregate of each other event -> when
	seen chan struct{}        // a value per other event
}

func (p *hangingPublisher) Publish(ctx context.Context, e *core.Event) error {
	if e.AggregateID == p.agg {
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
	pub := &hangingPublisher{agg: hot, release: make(chan struct{}), sent: map[string]time.Time{}, seen: make(chan struct{}, others)}
	r, err := core.New(in.s, pub, core.Options{PublishTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- r.Run(rctx) }()
	defer func() {
		close(pub.release)
		cancel()
		if err := <-done; err != nil {
			t.Errorf("relay: %v", err)
		}
	}()
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
