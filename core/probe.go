package core

import (
	"context"
	"errors"
	"time"
)

// outage is what the claim loop's probes have seen.
type outage struct {
	down bool      // a probe failed and none has succeeded since
	over time.Time // when a probe last succeeded after one had failed
}

// backoff waits d after a failed cycle, probing the store and the
// publisher every ProbeInterval. It returns early, true, when a probe
// succeeds after one had failed (o.down carries that across waits, so a
// server that came back between two waits still counts): the failure was
// an outage and it is over (o.over). A failure with every server
// answering gets the whole wait, so a batch that fails for other reasons
// cannot spin. False means stop.
func (r *Relay) backoff(ctx context.Context, d time.Duration, o *outage) bool {
	if len(r.pingers) == 0 {
		return r.sleep(ctx, d)
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
