package admin

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgtype"
	"github.com/outboxhq/outbox/store"
)

// Operator queries for events that do not go out: the functions behind
// `outbox stuck`, `outbox retry`, `outbox park` and `outbox unpark`.

const (
	// MaxSelected bounds the events one Stuck, Retry, Park or Unpark call
	// touches, so an operator command never turns into an unbounded scan or
	// one huge transaction. Call again while the count equals it.
	MaxSelected  = 10000
	defaultStuck = 100
)

// StuckOptions says which events Stuck lists.
type StuckOptions struct {
	// OlderThan lists pending events created at least this long ago;
	// zero means store.DefaultStuckAge. Events held for an operator (a
	// permanent failure) are listed whatever their age.
	OlderThan time.Duration
	Limit     int // at most this many, oldest first; default 100, at most MaxSelected
	// IncludeParked adds parked events, which are otherwise left out.
	IncludeParked bool
	// IncludeScheduled adds events waiting for their deliver-at time,
	// which are otherwise left out: they are not stuck.
	IncludeScheduled bool
}

// StuckEvent is one event that has not gone out.
type StuckEvent struct {
	Seq         int64
	ID          string
	AggregateID string
	Type        string
	CreatedAt   time.Time
	Attempts    int    // failed publish attempts
	LastError   string // reason of the last failed attempt; empty if none
	// RetryAt is when a transiently failed event may be tried again; zero
	// when it has not failed or is held.
	RetryAt time.Time
	// Held is a permanent failure: the event waits for Retry or Park and,
	// in ordered mode, holds back its aggregate meanwhile.
	Held         bool
	ParkedAt     time.Time // zero unless parked
	ParkedReason string
	// HeldBack counts later pending events of the same aggregate that
	// ordered mode keeps waiting behind this one (as EventInfo.HeldBack);
	// Blocking is HeldBack > 0.
	HeldBack int64
	Blocking bool
	// WaitsFor is the event to look at first: the earliest earlier event
	// of the aggregate that is not due yet (held, retrying, scheduled),
	// else, when this one is due, the earliest earlier pending event. Zero
	// when it waits for nothing but its own time.
	WaitsFor int64
	// DeliverAt is the producer's deliver-at time, zero if none;
	// Scheduled says the event is still waiting for it (and is not
	// stuck). In ordered mode it holds back its aggregate meanwhile.
	DeliverAt time.Time
	Scheduled bool
}

// Stuck lists events that have not gone out, oldest first: pending events
// due (created, or past their deliver-at time) before q.OlderThan ago, held
// events of any age and, when asked, parked and scheduled ones. It takes no locks and changes nothing.
func (s *Admin) Stuck(ctx context.Context, q StuckOptions) ([]StuckEvent, error) {
	switch {
	case q.OlderThan < 0:
		return nil, invalid("list stuck events: OlderThan %v is negative", q.OlderThan)
	case q.Limit < 0:
		return nil, invalid("list stuck events: Limit %d is negative", q.Limit)
	case q.Limit > MaxSelected:
		return nil, invalid("list stuck events: Limit %d is over the maximum of %d", q.Limit, MaxSelected)
	}
	if q.OlderThan == 0 {
		q.OlderThan = store.DefaultStuckAge
	}
	if q.Limit == 0 {
		q.Limit = defaultStuck
	}
	t := s.n.Outbox
	// Pending and parked rows are found through their own indexes; the
	// two counts use the (aggregate_id, id) index of the pending rows.
	pending := `SELECT seq FROM ` + t + `
    WHERE dispatched_at IS NULL AND parked_at IS NULL
      AND ((` + store.DueSQL + ` < now() - make_interval(secs => $1) AND NOT ` + store.ScheduledSQL + `) OR retry_at = 'infinity')
    ORDER BY seq LIMIT $2`
	if q.IncludeScheduled {
		pending = `(` + pending + `) UNION ALL (SELECT seq FROM ` + t + `
    WHERE dispatched_at IS NULL AND parked_at IS NULL AND ` + store.ScheduledSQL + ` ORDER BY seq LIMIT $2)`
	}
	if q.IncludeParked {
		pending = `(` + pending + `) UNION ALL (SELECT seq FROM ` + t + `
    WHERE dispatched_at IS NULL AND parked_at IS NOT NULL ORDER BY seq LIMIT $2)`
	}
	sql := `
SELECT o.seq, o.event_id::text, o.aggregate_id::text, o.type, o.created_at, o.attempts,
       COALESCE(o.last_error, ''), o.retry_at, o.parked_at, COALESCE(o.parked_reason, ''),
       ` + aggregateCols(t) + `,
       o.deliver_at, o.parked_at IS NULL AND ` + store.ScheduledSQL + `
FROM ` + t + ` o
WHERE o.seq IN (` + pending + `)
ORDER BY o.seq
LIMIT $2`
	rows, err := s.pool.Query(ctx, sql, q.OlderThan.Seconds(), q.Limit)
	if err != nil {
		return nil, fmt.Errorf("list stuck events: %w", err)
	}
	defer rows.Close()
	var out []StuckEvent
	for rows.Next() {
		var (
			e             StuckEvent
			retry, parked pgtype.Timestamptz
			waitsFor      *int64
			deliverAt     *time.Time
		)
		if err := rows.Scan(&e.Seq, &e.ID, &e.AggregateID, &e.Type, &e.CreatedAt, &e.Attempts,
			&e.LastError, &retry, &parked, &e.ParkedReason, &e.HeldBack, &waitsFor, &deliverAt, &e.Scheduled); err != nil {
			return nil, fmt.Errorf("list stuck events: scan: %w", err)
		}
		switch {
		case retry.Valid && retry.InfinityModifier == pgtype.Infinity:
			e.Held = true
		case retry.Valid && retry.InfinityModifier == pgtype.Finite && !e.Scheduled:
			e.RetryAt = retry.Time
		}
		if deliverAt != nil {
			e.DeliverAt = *deliverAt
		}
		if parked.Valid {
			e.ParkedAt = parked.Time
		}
		if waitsFor != nil {
			e.WaitsFor = *waitsFor
		}
		e.Blocking = e.HeldBack > 0
		out = append(out, e)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list stuck events: %w", err)
	}
	return out, nil
}

// Retry makes failed events that are waiting (held by a permanent failure
// or backing off after a transient one) available to the relay now. Use it
// after fixing what made them fail, such as a routing rule. It returns how
// many events it released.
func (s *Admin) Retry(ctx context.Context, sel Selector) (int64, error) {
	// A scheduled event not yet tried is waiting as asked, not failing.
	n, err := s.update(ctx, sel, actionStates[ActionRetry], s.handingOff, "retry_at = NULL, "+handOff)
	if err != nil {
		return 0, fmt.Errorf("retry events (%s): %w", sel, err)
	}
	s.log.Info("events released for retry", "selector", sel.String(), "count", n)
	return n, nil
}

// Park sets pending events aside with a reason: the relay no longer
// claims them, and in ordered mode later events of their aggregates go
// ahead. Parked events keep their row and identity; Stuck lists them with
// IncludeParked and Unpark puts them back.
func (s *Admin) Park(ctx context.Context, sel Selector, reason string) (int64, error) {
	reason = strings.TrimSpace(reason)
	switch {
	case reason == "":
		return 0, invalid("park events (%s): a reason is required", sel)
	case len(reason) > store.MaxReason:
		return 0, invalid("park events (%s): reason is %d bytes, over the limit of %d", sel, len(reason), store.MaxReason)
	}
	n, err := s.update(ctx, sel, actionStates[ActionPark], counted, "parked_at = now(), parked_reason = $1", reason)
	if err != nil {
		return 0, fmt.Errorf("park events (%s): %w", sel, err)
	}
	s.log.Info("events parked", "selector", sel.String(), "reason", reason, "count", n)
	return n, nil
}

// Unpark puts parked events back in the pending set with the same seq and
// event_id, ready now (or, when scheduled, at their deliver-at time). In ordered mode an unparked event again goes before the
// later pending events of its aggregate; events of that aggregate published
// while it was parked stay published, so consumers see it after them.
func (s *Admin) Unpark(ctx context.Context, sel Selector) (int64, error) {
	// A scheduled event goes back to waiting for its time.
	n, err := s.update(ctx, sel, actionStates[ActionUnpark], s.handingOff,
		"parked_at = NULL, parked_reason = NULL, retry_at = CASE WHEN u.deliver_at > now() THEN u.deliver_at END, "+handOff)
	if err != nil {
		return 0, fmt.Errorf("unpark events (%s): %w", sel, err)
	}
	s.log.Info("events unparked", "selector", sel.String(), "count", n)
	return n, nil
}

// actionStates are the undispatched events each action touches: Retry the
// failed ones waiting (held or backing off), Park the pending ones, Unpark
// the parked ones. Affected counts by the same conditions.
var actionStates = map[Action]string{
	ActionRetry:  "o.parked_at IS NULL AND o.retry_at IS NOT NULL AND o.attempts > 0",
	ActionPark:   "o.parked_at IS NULL",
	ActionUnpark: "o.parked_at IS NOT NULL",
}

// update applies set to the undispatched events matching sel and state,
// through wrap (counted, or handingOff when set makes rows pending again).
// Rows are locked in id order, as claims lock them, so a command waits for
// a relay's claim to end instead of deadlocking with it; a row the relay
// dispatched meanwhile no longer matches and is left alone.
func (s *Admin) update(ctx context.Context, sel Selector, state string, wrap func(update string) string, set string, setArgs ...any) (int64, error) {
	cond, args, err := sel.where("o", len(setArgs)+2)
	if err != nil {
		return 0, err
	}
	sql := wrap(`UPDATE ` + s.n.Outbox + ` AS u SET ` + set + `
WHERE u.seq IN (
    SELECT o.seq FROM ` + s.n.Outbox + ` o
    WHERE o.dispatched_at IS NULL AND ` + state + ` AND ` + cond + `
    ORDER BY o.seq
    LIMIT $` + strconv.Itoa(len(setArgs)+1) + `
    FOR UPDATE)
RETURNING u.aggregate_id, u.seq`)
	var n, last, noticed int64
	if err := s.pool.QueryRow(ctx, sql, append(append(setArgs, MaxSelected), args...)...).Scan(&n, &last, &noticed); err != nil {
		return 0, err
	}
	return n, nil
}

// counted wraps an update as handingOff does, without the message.
func counted(update string) string {
	return `WITH u AS (` + update + `) SELECT count(*), COALESCE(max(seq), 0), 0 FROM u`
}
