package core

import (
	"context"
	"fmt"
	"math"
	"sync"
	"time"
)

// claimLoop makes the claims, one at a time, while a claim may be opened
// and the queues are short, and backs off after failures.
func (r *Relay) claimLoop(ctx context.Context) {
	failures := 0
	var out outage
	fail := func(err error) bool {
		failures++
		wait := r.opts.ErrorBackoff.Delay(failures - 1)
		r.log.Error("relay cycle failed", "error", err, "retry_in", wait, "failures", failures)
		return r.backoff(ctx, wait, &out)
	}
	// Producers wake this relay only while it sleeps (Sleeper): it says
	// so when a claim finds nothing, or a few events after one that found
	// none, claims once more for what committed before, stays asleep
	// across wake-ups that bring it nothing (other relays' events) or a
	// trickle's few events, and ends the sleep, in the background, once
	// claims find events less than streamGap apart.
	sleeper, _ := r.store.(Sleeper)
	if _, ok := r.store.(Notifier); !ok || r.opts.DisableWakeups {
		sleeper = nil
	}
	var asleep bool
	// lastFound: when a claim last found events. A claim that finds a few
	// with none found for streamGap before is a trickle's: the relay
	// sleeps (or stays asleep) rather than lingers, for the claim after a
	// linger would most often find nothing and another would follow the
	// sleep.
	var lastFound time.Time
	var awaking sync.WaitGroup
	awake := func() {
		if !asleep {
			return
		}
		asleep = false
		awaking.Go(func() {
			if err := sleeper.Awake(context.WithoutCancel(ctx)); err != nil {
				r.log.Debug("end sleep", "error", err)
			}
		})
	}
	defer func() {
		awake()
		awaking.Wait()
	}()
	for !r.stopping() && ctx.Err() == nil {
		if !r.ready(ctx) {
			return
		}
		// A batch recorded since the last claim tells how the last round
		// went: a failure backs the loop off, a success resets the backoff.
		// A batch that failed before a probe saw the outage end failed in
		// the outage the loop has waited out already: no second wait.
		if ok, at, err := r.outcomes.take(); err != nil && at.After(out.over) {
			<-r.slots
			if !fail(err) {
				return
			}
			continue
		} else if err != nil {
			r.log.Debug("a batch failed before the outage ended", "error", err)
		} else if ok {
			failures, out.down = 0, false
		}
		next, opened, err := r.claimBatch(ctx)
		streaming := false
		if opened {
			now := time.Now()
			streaming = now.Sub(lastFound) < streamGap
			lastFound = now
		}
		if !opened {
			<-r.slots
		}
		if err != nil {
			if !fail(err) {
				return
			}
			continue
		}
		if next == idle && !opened {
			failures, out.down = 0, false // the store answered and had nothing
		}
		wait := r.opts.PollInterval
		switch next {
		case again:
			awake()
			continue
		case truncated:
			wait = min(wait, truncatedPause)
		}
		if sleeper != nil && next == idle && !streaming {
			// Nothing to claim, or a trickle's few events: sleep, or
			// stay asleep across a wake-up that brought this relay
			// nothing (another relay's event) or only those.
			if !asleep {
				awaking.Wait()
				now, err := sleeper.Sleep(ctx)
				if err != nil {
					r.log.Debug("sleep: producers may not wake this relay until the next poll", "error", err)
					if opened {
						wait = min(wait, lingerPoll) // events are arriving
					}
				} else {
					asleep = true
					if now {
						continue // claim what committed without waking anyone
					}
				}
			}
		} else {
			awake()
			if sleeper != nil && next == idle {
				// Events are arriving: claim again shortly rather than
				// ask every producer to wake this relay, which would
				// serialize their commits (see Sleeper).
				wait = min(wait, lingerPoll)
			}
		}
		woken, ok := r.nap(ctx, wait)
		if !ok {
			return
		}
		if !woken {
			// A poll: the sleep is made anew, in case the store lost it.
			awake()
		}
	}
}

// ready waits until a claim may be made: fewer claims are open than
// claimsWanted (it takes a slot for the next one) and fewer than a batch
// of events wait for a lane (see queuedCount), so the next batch arrives
// before the lanes run dry but memory stays bounded. While no claim may
// open it relieves stalled aggregates, however many events are queued, so
// that one slow publish cannot hold every claim open. False means stop.
func (r *Relay) ready(ctx context.Context) bool {
	var tick <-chan time.Time
	for {
		if (r.handsOff.Load() || r.sched.queuedCount() < r.opts.BatchSize) && len(r.slots) < r.claimsWanted() {
			select {
			case r.slots <- struct{}{}:
				return true
			default:
			}
		}
		r.sched.relieve(stallAfter)
		if tick == nil {
			t := time.NewTicker(stallAfter / 4)
			defer t.Stop()
			tick = t.C
		}
		select {
		case <-r.sched.kick:
		case <-tick:
		case <-r.stop:
			return false
		case <-ctx.Done():
			return false
		}
	}
}

// setPart records the share of the store's ordered work this relay claims
// from (Sharer) and claims at once, for what it may have gained.
func (r *Relay) setPart(part float64) {
	r.part.Store(math.Float64bits(min(max(part, 0), 1)))
	r.Wake()
}

// claimsWanted is how many claims may be open now. Each open claim is a
// transaction the database runs beside the others, and ordered claims
// step over the events their relay has in flight, so relays that share
// the work each open their part of Claimers (at least one): replicas add
// publishers, not concurrent transactions. While a batch has been open
// for over stallAfter (a slow publish), the relay opens up to Claimers,
// so that one slow event does not stop its claiming.
func (r *Relay) claimsWanted() int {
	part := math.Float64frombits(r.part.Load())
	if part >= 1 || r.sched.openOver(stallAfter) {
		return r.opts.Claimers
	}
	return max(1, int(math.Ceil(float64(r.opts.Claimers)*part)))
}

// stallAfter is how long an aggregate's publish may take before the
// events queued behind it, from newer claims, are let go so their claims
// can be recorded; next to it a normal publish is short.
const stallAfter = time.Second

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

// truncatedPause is the wait after a truncated claim: the store left
// events out because other relays held earlier events of their aggregates
// (or the claim reached its byte limit). Long enough not to spin on their
// locks, short next to a batch's publish time.
const truncatedPause = 20 * time.Millisecond

// sleep waits d; false means stop.
func (r *Relay) sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-r.stop:
		return false
	case <-ctx.Done():
		return false
	}
}

// nap is the claim loop's wait: d, or less when woken, which it reports;
// false for ok means stop.
func (r *Relay) nap(ctx context.Context, d time.Duration) (woken, ok bool) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return false, true
	case <-r.wake:
		return true, true
	case <-r.stop:
		return false, false
	case <-ctx.Done():
		return false, false
	}
}

// claimBatch makes one claim and queues its events. opened reports that a
// batch was opened (it then owns the slot ready took).
func (r *Relay) claimBatch(ctx context.Context) (next pace, opened bool, err error) {
	seq, inFlight, heldBack := r.sched.startClaim()
	start := time.Now()
	claim, err := r.store.Claim(ctx, ClaimOptions{Limit: r.opts.BatchSize, Unordered: r.opts.Unordered, InFlight: inFlight, HeldBack: heldBack})
	if err != nil {
		r.obs.Errored("claim", err)
		return idle, false, fmt.Errorf("claim batch: %w", err)
	}
	events := claim.Events()
	rejected := rejectedOf(claim)
	r.obs.Claimed(len(events), time.Since(start))
	next = idle
	switch {
	case len(events)+len(rejected) >= r.opts.BatchSize:
		next = again
	case isTruncated(claim) || len(rejected) > 0:
		next = truncated
	}
	if len(events) == 0 && len(rejected) == 0 {
		if err := claim.Release(ctx); err != nil {
			r.obs.Errored("release", err)
			return idle, false, fmt.Errorf("release empty claim: %w", err)
		}
		r.progress.Store(time.Now().UnixNano())
		return next, false, nil
	}
	r.progress.Store(time.Now().UnixNano())
	for _, rej := range rejected {
		r.log.Warn("event held: the row cannot be relayed", "event_seq", rej.Event.Seq, "event_id", rej.Event.ID, "aggregate_id", rej.Event.AggregateID, "error", rej.Err)
	}
	h, _ := claim.(HandOffer)
	b := &batch{seq: seq, opened: start, claim: claim, handOffer: h, events: events, rejected: rejected,
		states: make([]state, len(events)), errs: make([]error, len(events)), remaining: len(events)}
	if h != nil {
		r.handsOff.Store(true)
		<-r.slots // it holds nothing open (see handsOff)
	}
	r.open.Add(1)
	if !r.sched.add(b) {
		go r.complete(ctx, b) // nothing for the lanes: rejected rows only, or all let go
	}
	return next, true, nil
}

func rejectedOf(c Claim) []Rejection {
	if r, ok := c.(Rejecter); ok {
		return r.Rejected()
	}
	return nil
}

func isTruncated(c Claim) bool {
	t, ok := c.(Truncated)
	return ok && t.Truncated()
}
