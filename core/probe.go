package core

import (
	"context"
	"errors"
	"time"
)

// cycleBackoff is the claim loop's failure state: the cycles failed in a
// row, and what its probes have seen.
type cycleBackoff struct {
	r        *Relay
	failures int
	out      outage
}

// fail logs a failed cycle and backs off (see backoff); false means stop.
func (c *cycleBackoff) fail(ctx context.Context, err error) bool {
	c.failures++
	wait := c.r.opts.ErrorBackoff.Delay(c.failures - 1)
	c.r.log.Error("relay cycle failed", "error", err, "retry_in", wait, "failures", c.failures)
	return c.r.backoff(ctx, wait, &c.out)
}

// reset starts the count over: the last cycle went well.
func (c *cycleBackoff) reset() { c.failures, c.out.down = 0, false }

// recorded takes how the batches recorded since the last claim went
// (outcomes.take) and returns the failure to back off for, if any: a
// success resets the backoff. A batch that failed before a probe saw the
// outage end failed in the outage the loop has waited out already: no
// second wait.
func (c *cycleBackoff) recorded(ok bool, at time.Time, err error) error {
	switch {
	case err != nil && at.After(c.out.over):
		return err
	case err != nil:
		c.r.log.Debug("a batch failed before the outage ended", "error", err)
	case ok:
		c.reset()
	}
	return nil
}

// outage is what the claim loop's probes have seen.
type outage struct {
	down bool      // a probe failed and none has succeeded since
	over time.Time // when a probe last succeeded after one had failed
}

// backoff waits d after a failed cycle, probing the source and the
// publisher every ProbeInterval. It returns early, true, when a probe
// succeeds after one had failed (o.down carries that across waits, so a
// server that came back between two waits still counts): the failure was
// an outage and it is over (o.over). A failure with every server
// answering gets the whole wait, so a batch that fails for other reasons
// cannot spin. False means stop.
func (r *Relay) backoff(ctx context.Context, d time.Duration, o *outage) bool {
	if len(r.pingers) == 0 {
		_, ok := sleep(ctx, d, r.stop, nil)
		return ok
	}
	t := time.NewTimer(d)
	defer t.Stop()
	tick := time.NewTicker(r.opts.ProbeInterval)
	defer tick.Stop()
	pctx, cancel := context.WithCancel(ctx)
	// The first probe goes at once: a server that is down shows before
	// it can come back unseen.
	result := make(chan error, 1) // nil while no probe is running
	go func() { result <- r.probe(pctx) }()
	defer func() {
		cancel()
		if result != nil {
			<-result // pingers honour ctx; leave no probe running
		}
	}()
	for {
		select {
		case <-t.C:
			return true
		case <-r.stop:
			return false
		case <-ctx.Done():
			return false
		case <-tick.C:
			if result == nil {
				result = make(chan error, 1)
				go func() { result <- r.probe(pctx) }()
			}
		case err := <-result:
			result = nil
			if err != nil {
				if !o.down {
					r.log.Warn("probe failed; resuming as soon as it succeeds", "error", err)
				}
				o.down = true
				continue
			}
			if o.down {
				o.down, o.over = false, time.Now()
				r.log.Info("probe succeeded; resuming")
				return true
			}
		}
	}
}

// probe pings every pinger, each bounded by ProbeTimeout, and returns the
// first error.
func (r *Relay) probe(ctx context.Context) error {
	for _, p := range r.pingers {
		pctx, cancel := context.WithTimeout(ctx, r.opts.ProbeTimeout)
		err := p.Ping(pctx)
		cancel()
		if err != nil && !errors.Is(err, errors.ErrUnsupported) {
			return err
		}
	}
	return nil
}
