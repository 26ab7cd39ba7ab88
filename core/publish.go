package core

import (
	"context"
	"errors"
	"time"
)

// work is one lane: it publishes queued events until the lanes close.
func (r *Relay) work(ctx context.Context) {
	// Each publish's timeout context hangs off this lane's own, so lanes
	// do not contend for the relay's context to register and remove them.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	pctx := newPublishCtx(ctx, r.opts.PublishTimeout)
	defer pctx.close()
	for {
		it, ok := r.sched.take()
		if !ok {
			return
		}
		e := &it.b.events[it.i]
		switch {
		case ctx.Err() != nil:
			r.sched.finish(it, stLeft, nil) // a hard stop: leave it pending
		case it.b.handOffer != nil:
			st, err := r.publishOrHandOff(ctx, pctx, it.b.handOffer, e)
			r.sched.finish(it, st, err)
		default:
			err := r.publish(ctx, pctx, e)
			// Cancelled by a hard stop: not the event's fault; leave it pending.
			if err != nil && ctx.Err() != nil && errors.Is(err, ctx.Err()) {
				r.sched.finish(it, stLeft, nil)
			} else if err != nil {
				r.sched.finish(it, stFailed, err)
			} else {
				r.sched.finish(it, stPublished, nil)
			}
		}
	}
}

// publish makes one publish attempt under pctx, the lane's context ctx
// bounded by PublishTimeout.
func (r *Relay) publish(ctx context.Context, pctx *publishCtx, e *Event) error {
	start := time.Now()
	pctx.start(start)
	err := r.pub.Publish(pctx, e)
	pctx.stop()
	r.obs.Published(e, time.Since(start), err)
	if err != nil && (ctx.Err() == nil || !errors.Is(err, ctx.Err())) {
		r.log.Warn("publish failed", "event_seq", e.Seq, "event_id", e.ID, "aggregate_id", e.AggregateID,
			"type", e.Type, "attempt", e.Attempts+1, "permanent", IsPermanent(err), "error", err)
	}
	return err
}

// publishOrHandOff resolves e of a claim that cannot offer it again: it
// is published, retried in place through transient failures, or handed
// off (its error, if any, is the failure recorded with it). stLeft means
// the relay stopped first.
func (r *Relay) publishOrHandOff(ctx context.Context, pctx *publishCtx, h HandOffer, e *Event) (state, error) {
	if c, ok := r.pub.(Committer); ok {
		// In the broker already (read again after a crash): handing it
		// off would publish it a second time. The first answer is asked
		// directly: a wrapper answers every event, so this is per event.
		sent, err := c.Sent(ctx, e)
		if err != nil {
			if sent, ok = retryRecord(ctx, r, "ask the publisher", func() (bool, error) { return c.Sent(ctx, e) }); !ok {
				return stLeft, nil
			}
		}
		if sent {
			return stPublished, nil
		}
	}
	off, ok := retryRecord(ctx, r, "check hand-off", func() (bool, error) { return h.MustHandOff(ctx, e) })
	switch {
	case !ok:
		return stLeft, nil
	case off:
		if _, ok := retryRecord(ctx, r, "hand off event", func() (struct{}, error) { return struct{}{}, h.HandOff(ctx, e, nil) }); !ok {
			return stLeft, nil
		}
		return stHandedOff, nil
	}
	var firstFailure int64
	for attempt := 0; ; attempt++ {
		start := time.Now().UnixNano()
		err := r.publish(ctx, pctx, e)
		if err == nil {
			r.published.Store(time.Now().UnixNano())
			return stPublished, nil
		}
		if ctx.Err() != nil {
			return stLeft, nil
		}
		if firstFailure == 0 {
			firstFailure = start
		}
		f := Failure{Seq: e.Seq, Reason: err.Error()}
		if !IsPermanent(err) {
			e.Attempts++
			delay := r.opts.RetryBackoff.Delay(attempt)
			// Failing alone while others are published, or while the
			// broker answers its ping: this event, not the broker.
			alone := r.opts.HandOffAfter > 0 && attempt+1 >= r.opts.HandOffAfter &&
				(r.published.Load() > firstFailure || r.publisherAnswers(ctx))
			if !alone {
				if _, ok := sleep(ctx, delay, r.stop, nil); !ok {
					return stLeft, nil
				}
				continue
			}
			f.RetryAt = time.Now().Add(delay)
		}
		if _, ok := retryRecord(ctx, r, "hand off event", func() (struct{}, error) { return struct{}{}, h.HandOff(ctx, e, &f) }); !ok {
			return stLeft, nil
		}
		return stHandedOff, err
	}
}

// publisherAnswers says whether the publisher, if it can be pinged,
// answers.
func (r *Relay) publisherAnswers(ctx context.Context) bool {
	p, ok := r.pub.(Pinger)
	if !ok {
		return false
	}
	pctx, cancel := context.WithTimeout(ctx, r.opts.ProbeTimeout)
	defer cancel()
	return p.Ping(pctx) == nil
}
