package core_test

import (
	"errors"
	"testing"
	"time"

	"github.com/outboxhq/outbox/core"
)

// Observers passes every measurement to each observer.
func TestObserversFanOut(t *testing.T) {
	a, b := &observer{}, &observer{}
	obs := core.Observers{a, b}
	obs.Claimed(1, time.Millisecond)
	obs.Published(&core.Event{}, time.Millisecond, nil)
	obs.Errored("claim", errors.New("x"))
	obs.Rejected(&core.Event{}, errors.New("x"))
	obs.Completed(1, 0, time.Millisecond)
	for i, o := range []*observer{a, b} {
		if o.claims.Load() != 1 || o.published.Load() != 1 || o.errored.Load() != 1 || o.rejected.Load() != 1 {
			t.Errorf("observer %d saw claims %d, published %d, errored %d, rejected %d; want 1 each",
				i, o.claims.Load(), o.published.Load(), o.errored.Load(), o.rejected.Load())
		}
	}
}
