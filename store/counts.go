package store

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// DefaultStuckAge is how long an event may stay pending before it counts
// as stuck.
const DefaultStuckAge = 5 * time.Minute

// A pending event is scheduled while its deliver-at time is ahead and it
// has not been tried: the claim leaves it alone as asked. Its age counts
// from when it became due.
const (
	ScheduledSQL = `(deliver_at IS NOT NULL AND deliver_at > now() AND attempts = 0)`
	DueSQL       = `greatest(created_at, deliver_at)`
)

// Counts is the backlog of an outbox, read in one statement.
type Counts struct {
	Pending  int64 // neither dispatched nor parked; scheduled ones included
	Retrying int64 // pending and backing off after a transient failure
	Held     int64 // pending and held for an operator by a permanent failure
	// Scheduled counts pending events whose deliver-at time is still to
	// come: waiting as asked, neither stuck nor retrying.
	Scheduled int64
	Parked    int64
	Stuck     int64 // due for longer than the stuck age, or held
	// OldestPending is when the oldest pending event became due (zero if
	// none): its creation, or its deliver-at time when that is later.
	// Events scheduled for later are left out. OldestPendingAge is the
	// database clock's now() minus it.
	OldestPending    time.Time
	OldestPendingAge time.Duration
	// DispatchedLastMinute counts events marked dispatched in the minute
	// before the snapshot: the publish rate per minute.
	DispatchedLastMinute int64
	Now                  time.Time // the database clock at the snapshot
}

// Count counts the backlog of n's outbox; an event pending longer than
// stuckAfter (zero: DefaultStuckAge) counts as stuck. Every count is
// served by a partial index over pending rows or by the dispatched_at
// index, so its cost follows the backlog, not the table's size.
func Count(ctx context.Context, pool *pgxpool.Pool, n Names, stuckAfter time.Duration) (Counts, error) {
	if stuckAfter < 0 {
		return Counts{}, fmt.Errorf("read outbox status: StuckAfter %v is negative", stuckAfter)
	}
	if stuckAfter == 0 {
		stuckAfter = DefaultStuckAge
	}
	t := n.Outbox
	sql := `
SELECT p.pending, p.retrying, p.held, p.scheduled, p.stuck, p.oldest,
       (SELECT count(*) FROM ` + t + ` WHERE dispatched_at IS NULL AND parked_at IS NOT NULL),
       (SELECT count(*) FROM ` + t + ` WHERE dispatched_at > now() - interval '1 minute'),
       now()
FROM (
    SELECT count(*) AS pending,
           count(*) FILTER (WHERE retry_at > now() AND retry_at < 'infinity' AND NOT ` + ScheduledSQL + `) AS retrying,
           count(*) FILTER (WHERE retry_at = 'infinity') AS held,
           count(*) FILTER (WHERE ` + ScheduledSQL + `) AS scheduled,
           count(*) FILTER (WHERE ` + DueSQL + ` < now() - make_interval(secs => $1) OR retry_at = 'infinity') AS stuck,
           min(` + DueSQL + `) FILTER (WHERE NOT ` + ScheduledSQL + `) AS oldest
    FROM ` + t + `
    WHERE dispatched_at IS NULL AND parked_at IS NULL
) p`
	var (
		c      Counts
		oldest *time.Time
	)
	if err := pool.QueryRow(ctx, sql, stuckAfter.Seconds()).Scan(&c.Pending, &c.Retrying, &c.Held,
		&c.Scheduled, &c.Stuck, &oldest, &c.Parked, &c.DispatchedLastMinute, &c.Now); err != nil {
		return Counts{}, fmt.Errorf("read outbox status: %w", err)
	}
	if oldest != nil {
		c.OldestPending = *oldest
		c.OldestPendingAge = max(c.Now.Sub(*oldest), 0)
	}
	return c, nil
}
