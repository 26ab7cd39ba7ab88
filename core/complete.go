package core

import (
	"context"
	"fmt"
	"sync"
	"time"
)

// retryRecord calls f until it succeeds, backing off with ErrorBackoff;
// ok is false when the relay stopped first. f runs under ctx; the waits
// between its calls end on a stop too.
func retryRecord[T any](ctx context.Context, r *Relay, what string, f func() (T, error)) (v T, ok bool) {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(r.halted, cancel)()
	err := r.opts.ErrorBackoff.Retry(wctx, func(func()) (err error) {
		v, err = f()
		return err
	}, func(err error, wait time.Duration) {
		r.obs.Errored("record", err)
		r.log.Error(what+" failed", "error", err, "retry_in", wait)
	})
	return v, err == nil
}

// complete records a batch whose every event is resolved, in the batch's
// own claim, and frees its slot.
func (r *Relay) complete(ctx context.Context, b *batch) {
	defer r.open.Done()
	now := time.Now()
	rec := b.tally(now, r.opts.RetryBackoff)
	done, failed := rec.done, rec.failed
	// A hard stop cancelled ctx; still record what reached the broker, so
	// it is not published again.
	rctx := ctx
	if ctx.Err() != nil {
		var cancel context.CancelFunc
		rctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
	}
	start := time.Now()
	err := b.claim.Complete(rctx, done, failed)
	r.sched.closeBatch(b)
	if b.handOffer == nil {
		r.releaseSlot()
	}
	defer r.sched.signal()
	if err != nil {
		r.obs.Errored("complete", err)
		r.outcomes.put(fmt.Errorf("complete batch of %d: %w", len(b.events)+len(b.rejected), err), time.Now())
		return
	}
	r.obs.Completed(len(done), len(failed)+rec.handedOff, time.Since(start))
	// Reported once recorded: a row is held only now, and a batch that
	// failed to complete is claimed again and rejected anew.
	for i, rej := range b.rejected {
		r.obs.Rejected(&rej.Event, rec.rejections[i])
	}
	r.progress.Store(time.Now().UnixNano())
	// Nothing went out and the broker gave transient errors: it is likely
	// down. Back off the loop rather than hammering the broker and the
	// database. Held or undeliverable events alone mean the broker answered.
	if len(done) == 0 && rec.brokerFailed {
		r.outcomes.put(fmt.Errorf("publish batch: all %d attempted events failed, first: %s", len(failed), failed[0].Reason), now)
		return
	}
	r.outcomes.put(nil, now)
}

// tally is what complete records of a batch.
type tally struct {
	done       []int64   // published
	failed     []Failure // failed publishes, then rejected rows
	rejections []error   // the error recorded with each rejected row
	handedOff  int       // failures the source recorded as it took them (held or retried)
	// brokerFailed is set by a transient failure that may be the broker's.
	brokerFailed bool
}

// tally sorts b's resolved events at now; a transient failure's retry
// time comes from retry.
func (b *batch) tally(now time.Time, retry Backoff) tally {
	var t tally
	for i, st := range b.states {
		switch st {
		case stHandedOff:
			if b.errs[i] != nil {
				t.handedOff++
			}
		case stPublished:
			t.done = append(t.done, b.events[i].Seq)
		case stFailed:
			err := b.errs[i]
			f := Failure{Seq: b.events[i].Seq, Reason: err.Error()}
			if !IsPermanent(err) {
				f.RetryAt = now.Add(retry.Delay(b.events[i].Attempts))
				t.brokerFailed = t.brokerFailed || !IsUndeliverable(err)
			}
			t.failed = append(t.failed, f)
		}
	}
	t.rejections = make([]error, len(b.rejected))
	for i, rej := range b.rejected {
		t.rejections[i] = Permanent(fmt.Errorf("cannot relay row: %w", rej.Err))
		t.failed = append(t.failed, Failure{Seq: rej.Event.Seq, Reason: t.rejections[i].Error()})
	}
	return t
}

// outcomes collects how recorded batches went, for the claim loop.
type outcomes struct {
	mu  sync.Mutex
	err error     // the first failure since the last take
	at  time.Time // when the last of those failures happened
	ok  bool      // a batch was recorded without failing since the last take
}

// put records how a batch went; at is when it failed (its last event's
// failure).
func (o *outcomes) put(err error, at time.Time) {
	o.mu.Lock()
	defer o.mu.Unlock()
	switch {
	case err == nil:
		o.ok = true
	case o.err == nil:
		o.err, o.at = err, at
	case at.After(o.at):
		o.at = at
	}
}

// take returns and clears the first failure, when the last failure
// happened, and whether a batch was recorded without one.
func (o *outcomes) take() (ok bool, at time.Time, err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	ok, at, err = o.ok, o.at, o.err
	o.err, o.ok, o.at = nil, false, time.Time{}
	return ok, at, err
}
