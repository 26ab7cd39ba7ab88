package core

import (
	"context"
	"fmt"
	"math"
	"time"
)

// claimLoop makes the claims, one at a time, while a claim may be opened
// and the queues are short, and backs off after failures.
func (r *Relay) claimLoop(ctx context.Context) {
	fails := cycleBackoff{r: r}
	sl := newSleepState(r)
	defer sl.close(ctx)
	for !r.stopping() && ctx.Err() == nil {
		if !r.takeSlot(ctx) {
			return
		}
		if err := fails.recorded(r.outcomes.take()); err != nil {
			r.releaseSlot()
			if !fails.fail(ctx, err) {
				return
			}
			continue
		}
		next, opened, err := r.claimBatch(ctx)
		if err != nil {
			if !fails.fail(ctx, err) {
				return
			}
			continue
		}
		if next == idle && !opened {
			fails.reset() // the source answered and had nothing
		}
		wait, now := sl.pause(ctx, next, opened, r.opts.PollInterval)
		if now {
			continue
		}
		woken, ok := sleep(ctx, wait, r.stop, r.wake)
		if !ok {
			return
		}
		if !woken {
			// A poll: the sleep is made anew, in case the source lost it.
			sl.awake(ctx)
		}
	}
}

// takeSlot waits until a claim may be made and takes a slot for it:
// fewer claims are open than claimsWanted, and fewer than a batch
// of events wait for a lane (see queuedCount), so the next batch arrives
// before the lanes run dry but memory stays bounded. While no claim may
// open it relieves stalled aggregates, however many events are queued, so
// that one slow publish cannot hold every claim open. False means stop.
func (r *Relay) takeSlot(ctx context.Context) bool {
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

// releaseSlot gives back the slot takeSlot took. The claim loop owns the
// slot until claimBatch opens a batch on it; complete then releases it
// (claimBatch at once for a batch that hands off, see handsOff).
func (r *Relay) releaseSlot() { <-r.slots }

// setShare records the share of the source's ordered work this relay
// claims from (Sharer) and claims at once, for what it may have gained.
func (r *Relay) setShare(share float64) {
	r.share.Store(math.Float64bits(min(max(share, 0), 1)))
	r.Wake()
}

// claimsWanted is how many claims may be open now. Each open claim is a
// transaction the database runs beside the others, and ordered claims
// step over the events their relay has in flight, so relays that share
// the work each open their share of Claimers (at least one): replicas add
// publishers, not concurrent transactions. While a batch has been open
// for over stallAfter (a slow publish), the relay opens up to Claimers,
// so that one slow event does not stop its claiming.
func (r *Relay) claimsWanted() int {
	share := math.Float64frombits(r.share.Load())
	if share >= 1 || r.sched.openOver(stallAfter) {
		return r.opts.Claimers
	}
	return max(1, int(math.Ceil(float64(r.opts.Claimers)*share)))
}

// stallAfter is how long an aggregate's publish may take before the
// events queued behind it, from newer claims, are let go so their claims
// can be recorded; next to it a normal publish is short.
const stallAfter = time.Second

// claimBatch makes one claim and queues its events, on the slot takeSlot
// took: opened reports that a batch was opened, which holds the slot until
// it is recorded; otherwise the slot is released.
func (r *Relay) claimBatch(ctx context.Context) (next pace, opened bool, err error) {
	defer func() {
		if !opened {
			r.releaseSlot()
		}
	}()
	seq, inFlight, heldBack := r.sched.startClaim()
	start := time.Now()
	claim, err := r.src.Claim(ctx, ClaimOptions{Limit: r.opts.BatchSize, Unordered: r.opts.Unordered, InFlight: inFlight, HeldBack: heldBack})
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
		r.releaseSlot() // it holds nothing open (see handsOff)
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
