package logrelay_test

import (
	"context"
	"errors"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store/logrelay"
)

// A Pair publishes what its log relay hands to the table, without a table
// relay of the caller's: an event that keeps failing goes to the table,
// its aggregate's later events follow it there, and the pair's table
// relay publishes them in order once the broker takes them. The caller's
// HandedOff still runs, and Ready reports both relays.
func TestPairPublishesWhatItHandsOff(t *testing.T) {
	if _, err := logrelay.NewPair(nil, nil, logrelay.Options{}, nil, core.Options{}); err == nil {
		t.Fatal("NewPair without pool and publisher: no error")
	}
	e := newEnv(t)
	e.createSlot()
	agg := uuid.NewString()
	var failing atomic.Bool
	failing.Store(true)
	// It pings, so the relay reads the failures as the event's, not an
	// outage, and hands the event off.
	pub := &pingingRecorder{recorder: recorder{fail: func(ev *core.Event) error {
		if ev.AggregateID == agg && n(*ev) == 1 && failing.Load() {
			return errors.New("flaky downstream")
		}
		return nil
	}}}
	o := e.opts()
	o.HandOffAfter = 2
	var handedOff atomic.Int64
	o.HandedOff = func() { handedOff.Add(1) }
	p, err := logrelay.NewPair(e.pool, pub, o, handOff(t, e.pool, o, nil), core.Options{PollInterval: 50 * time.Millisecond,
		RetryBackoff: core.Backoff{Min: 10 * time.Millisecond, Max: 50 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, c := range p.Ready(context.Background()) {
		names = append(names, c.Name)
	}
	slices.Sort(names)
	if want := []string{"log", "log_progress", "progress", "publisher", "store"}; !slices.Equal(names, want) {
		t.Fatalf("checks before Run = %v, want %v", names, want)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("pair: %v", err)
		}
	}()
	e.write(true, agg, 0, 4)
	// Bound: two failed publishes and a hand-off take well under a
	// second; 60 s covers the server every package of `make test` shares.
	waitFor(t, 60*time.Second, "the failing event and the ones after it in the table", func() bool {
		return e.count("handoff_at IS NOT NULL AND dispatched_at IS NULL") == 3
	})
	if handedOff.Load() == 0 {
		t.Fatal("the caller's HandedOff was not called")
	}
	failing.Store(false)
	waitFor(t, 60*time.Second, "the pair's table relay to publish them", func() bool {
		o, _ := firstOrder(pub.events())
		return len(o[agg]) == 4
	})
	if got, _ := firstOrder(pub.events()); !slices.Equal(got[agg], []int{0, 1, 2, 3}) {
		t.Fatalf("first deliveries %v, want 0 1 2 3", got[agg])
	}
}
