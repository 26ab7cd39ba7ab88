package core

import (
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
