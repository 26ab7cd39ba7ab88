package core

import (
	"context"
	"math/rand/v2"
	"time"
)

// Backoff is capped exponential backoff with full jitter on the upper half:
// attempt n waits between d/2 and d, where d = Min * 2^n capped at Max.
type Backoff struct {
	Min time.Duration
	Max time.Duration
}

// Delay returns the wait before retry number attempt (0 is the first retry).
func (b Backoff) Delay(attempt int) time.Duration {
	d := b.Min
	for i := 0; i < attempt && d < b.Max; i++ {
		if d > b.Max/2 {
			d = b.Max // doubling would pass Max, or overflow
			break
		}
		d *= 2
	}
	if d > b.Max {
		d = b.Max
	}
	if d <= 1 {
		return d
	}
	half := d / 2
	return half + rand.N(d-half)
}

// Retry calls f until it returns nil or ctx ends, waiting b.Delay(n)
// after the n-th failure in a row (n from 0). f may call reset to start
// the count over, as a session that connected and later failed does.
// failed, if not nil, hears each failure and the wait that follows it;
// it is not called for a failure that comes once ctx has ended. The
// error is nil once f succeeded, else ctx's.
func (b Backoff) Retry(ctx context.Context, f func(reset func()) error, failed func(err error, wait time.Duration)) error {
	attempt := 0
	reset := func() { attempt = 0 }
	for {
		err := f(reset)
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		wait := b.Delay(attempt)
		attempt++
		if failed != nil {
			failed(err, wait)
		}
		if !sleep(ctx, nil, wait) {
			return ctx.Err()
		}
	}
}

// sleep waits d; false means ctx ended or stop closed first. A nil stop
// never closes.
func sleep(ctx context.Context, stop <-chan struct{}, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-stop:
		return false
	case <-ctx.Done():
		return false
	}
}
