package core

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// Check is the outcome of one readiness condition.
type Check struct {
	Name string // "store", "publisher" or "progress"
	Err  error  // nil when the condition holds
}

// Ready tells whether the relay can do its work, for a readiness probe:
// it pings the source and the publisher (those that implement Pinger),
// concurrently and within ctx, and checks that a cycle completed within
// StaleAfter (counting from Start until the first one). The relay is
// ready when every Check's Err is nil.
func (r *Relay) Ready(ctx context.Context) []Check {
	checks := []Check{{Name: "progress", Err: r.progressErr(time.Now())}}
	var (
		mu sync.Mutex
		wg sync.WaitGroup
	)
	for name, v := range map[string]any{"store": r.src, "publisher": r.pub} {
		p, ok := v.(Pinger)
		if !ok {
			continue
		}
		wg.Go(func() {
			err := p.Ping(ctx)
			if errors.Is(err, errors.ErrUnsupported) {
				return // cannot tell: no check
			}
			mu.Lock()
			checks = append(checks, Check{Name: name, Err: err})
			mu.Unlock()
		})
	}
	wg.Wait()
	return checks
}

func (r *Relay) progressErr(now time.Time) error {
	start := r.startAt.Load()
	if start == 0 {
		return errors.New("relay not started")
	}
	last := r.progress.Load()
	if last == 0 {
		last = start
	}
	if age := now.Sub(time.Unix(0, last)); age > r.opts.StaleAfter {
		return fmt.Errorf("no completed relay cycle for %s (limit %s)", age.Round(time.Second), r.opts.StaleAfter)
	}
	return nil
}
