package table

import (
	"context"
	"time"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store"
)

// Backlog counts the events still to publish (core.BacklogReader);
// stuckAfter zero means store.DefaultStuckAge.
func (s *Source) Backlog(ctx context.Context, stuckAfter time.Duration) (core.Backlog, error) {
	c, err := store.Count(ctx, s.pool, s.n, stuckAfter)
	if err != nil {
		return core.Backlog{}, err
	}
	return core.Backlog{Pending: c.Pending, Retrying: c.Retrying, Held: c.Held, Parked: c.Parked,
		Stuck: c.Stuck, OldestPendingAge: c.OldestPendingAge}, nil
}
