package core_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/memsource"
)

// holdingSource is a source that must hold something (a mode lock)
// before its relay claims.
type holdingSource struct {
	*memsource.Store
	hold func(ctx context.Context, held func()) error
}

func (s holdingSource) Hold(ctx context.Context, held func()) error { return s.hold(ctx, held) }

func TestRelayClaimsOnlyOnceHeld(t *testing.T) {
	s := memsource.New()
	id := s.Add(core.Event{AggregateID: "a", Type: "t.x"})[0]
	gate := make(chan struct{})
	var holding, claimedUnheld atomic.Bool
	src := holdingSource{Store: s, hold: func(ctx context.Context, held func()) error {
		select {
		case <-gate:
		case <-ctx.Done():
			return ctx.Err()
		}
		holding.Store(true)
		held()
		<-ctx.Done()
		holding.Store(false)
		return ctx.Err()
	}}
	var published log
	pub := pubFunc(func(ctx context.Context, e *core.Event) error {
		if !holding.Load() {
			claimedUnheld.Store(true)
		}
		published.add(e)
		return nil
	})
	r, err := core.New(src, pub, core.Options{PollInterval: 5 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	time.Sleep(200 * time.Millisecond) // forty polls
	if published.has(id) {
		t.Fatal("the relay published before its source held")
	}
	close(gate)
	waitFor(t, "the event to be published once held", func() bool { return published.has(id) })
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run = %v, want nil after cancel", err)
	}
	if claimedUnheld.Load() {
		t.Error("an event was published while the source did not hold")
	}
	if holding.Load() {
		t.Error("Run returned with Hold still running")
	}
}

func TestHoldErrorStopsRelay(t *testing.T) {
	errMixed := errors.New("another mode's relay reads this outbox")
	for _, tc := range []struct {
		name      string
		afterHeld bool // the hold is lost after it was held
	}{{"refused", false}, {"lost", true}} {
		t.Run(tc.name, func(t *testing.T) {
			s := memsource.New()
			lose := make(chan struct{})
			src := holdingSource{Store: s, hold: func(ctx context.Context, held func()) error {
				if tc.afterHeld {
					held()
					<-lose
				}
				return errMixed
			}}
			var published log
			pub := pubFunc(func(ctx context.Context, e *core.Event) error { published.add(e); return nil })
			r, err := core.New(src, pub, core.Options{PollInterval: 5 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			if !tc.afterHeld {
				s.Add(core.Event{AggregateID: "a", Type: "t.x"})
			}
			done := make(chan error, 1)
			go func() { done <- r.Run(context.Background()) }()
			if tc.afterHeld {
				id := s.Add(core.Event{AggregateID: "a", Type: "t.x"})[0]
				waitFor(t, "the event to be published while held", func() bool { return published.has(id) })
				close(lose)
			}
			select {
			case err := <-done:
				if !errors.Is(err, errMixed) {
					t.Fatalf("Run = %v, want Hold's error", err)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("the relay kept running after its source's Hold returned")
			}
			if !tc.afterHeld && len(published.ids()) > 0 {
				t.Error("the relay published without its source holding")
			}
		})
	}
}
