package dedupe

import (
	"context"
	"fmt"
	"time"
)

// Cleanup deletes this consumer's records older than olderThan, batchSize
// rows per statement so no transaction holds many locks or much WAL, until
// none are left or ctx is cancelled. It returns how many it deleted.
//
// A record must outlive every redelivery of its event: once deleted, a late
// duplicate (a relay replay, a broker redelivery after a long outage, a
// consumer reading from an old offset) runs again. Choose olderThan well
// beyond the longest such horizon, in days rather than minutes.
func (d *Deduper[T]) Cleanup(ctx context.Context, olderThan time.Duration, batchSize int) (deleted int64, err error) {
	switch {
	case olderThan <= 0:
		return 0, fmt.Errorf("clean up processed events: olderThan %v must be positive", olderThan)
	case batchSize <= 0:
		return 0, fmt.Errorf("clean up processed events: batchSize %d must be positive", batchSize)
	}
	for {
		if err := ctx.Err(); err != nil {
			return deleted, fmt.Errorf("clean up processed events: %w", err)
		}
		n, err := d.tx.cleanup(ctx, d.processed, d.opts.Consumer, olderThan, batchSize)
		if err != nil {
			return deleted, fmt.Errorf("clean up processed events: %w", err)
		}
		deleted += n
		if n < int64(batchSize) {
			return deleted, nil
		}
	}
}
