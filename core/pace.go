package core

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// pace says when the loop should claim next.
type pace int

const (
	idle      pace = iota // caught up: wait for a wake-up or the poll interval
	again                 // a full batch: more is waiting, claim at once
	truncated             // the claim left pending events out (core.Truncated)
)

// lingerPoll is the wait after a claim that found events but not a full
// batch, as did a claim less than streamGap before, for a relay whose
// producers wake it only while it sleeps: short
// next to a commit-to-delivery goal of milliseconds, long enough that a
// relay keeping up with a steady stream claims a handful of events at a
// time.
const lingerPoll = 2 * time.Millisecond

// streamGap is the longest time between two claims that find events for
// the events to count as a stream the relay lingers for, rather than a
// trickle it sleeps through, woken by each producer: over a linger and
// its claim's round trip, under the 10 ms between events at 100/s.
const streamGap = 5 * time.Millisecond

// truncatedPause is the wait after a truncated claim: the source left
// events out because other relays held earlier events of their aggregates
// (or the claim reached its byte limit). Long enough not to spin on their
// locks, short next to a batch's publish time.
const truncatedPause = 20 * time.Millisecond

// sleepState is the claim loop's sleep (Sleeper). Producers wake this
// relay only while it sleeps: it says so when a claim finds nothing, or a
// few events after one that found none, claims once more for what
// committed before, stays asleep across wake-ups that bring it nothing
// (other relays' events) or a trickle's few events, and ends the sleep, in
// the background, once claims find events less than streamGap apart.
type sleepState struct {
	sleeper Sleeper // nil without wake-ups, or with a source that wakes the relay for every event
	log     *slog.Logger
	asleep  bool
	awaking sync.WaitGroup // the Awake calls under way
	// lastFound: when a claim last found events. A claim that finds a few
	// with none found for streamGap before is a trickle's: the relay
	// sleeps (or stays asleep) rather than lingers, for the claim after a
	// linger would most often find nothing and another would follow the
	// sleep.
	lastFound time.Time
}

func newSleepState(r *Relay) *sleepState {
	sleeper, _ := r.src.(Sleeper)
	if _, ok := r.src.(Notifier); !ok || r.opts.DisableWakeups {
		sleeper = nil
	}
	return &sleepState{sleeper: sleeper, log: r.log}
}

// pause says how long the claim loop waits after a claim that returned
// next and opened a batch or not, poll being its usual wait; now means
// claim at once. It makes the sleep, or ends it, as the claim tells.
func (s *sleepState) pause(ctx context.Context, next pace, opened bool, poll time.Duration) (wait time.Duration, now bool) {
	streaming := false
	if opened {
		t := time.Now()
		streaming = t.Sub(s.lastFound) < streamGap
		s.lastFound = t
	}
	wait = poll
	switch next {
	case again:
		s.awake(ctx)
		return 0, true
	case truncated:
		wait = min(wait, truncatedPause)
	}
	if s.sleeper == nil {
		return wait, false
	}
	if next != idle || streaming {
		s.awake(ctx)
		if next == idle {
			// Events are arriving: claim again shortly rather than
			// ask every producer to wake this relay, which would
			// serialize their commits (see Sleeper).
			wait = min(wait, lingerPoll)
		}
		return wait, false
	}
	// Nothing to claim, or a trickle's few events: sleep, or stay asleep
	// across a wake-up that brought this relay nothing (another relay's
	// event) or only those.
	if s.asleep {
		return wait, false
	}
	s.awaking.Wait()
	now, err := s.sleeper.Sleep(ctx)
	if err != nil {
		s.log.Debug("sleep: producers may not wake this relay until the next poll", "error", err)
		if opened {
			wait = min(wait, lingerPoll) // events are arriving
		}
		return wait, false
	}
	s.asleep = true
	return wait, now // now: claim what committed without waking anyone
}

// awake ends the sleep, in the background.
func (s *sleepState) awake(ctx context.Context) {
	if !s.asleep {
		return
	}
	s.asleep = false
	s.awaking.Go(func() {
		if err := s.sleeper.Awake(context.WithoutCancel(ctx)); err != nil {
			s.log.Debug("end sleep", "error", err)
		}
	})
}

// close ends the sleep and waits for it to end.
func (s *sleepState) close(ctx context.Context) {
	s.awake(ctx)
	s.awaking.Wait()
}
