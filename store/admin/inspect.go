package admin

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/outboxhq/outbox/core/event"
	"github.com/outboxhq/outbox/store"
)

// Read-only queries behind the operator console: events by state with
// filters, one event with its aggregate's neighbours, failures grouped by
// error, activity per minute, and the count an action would touch. None
// takes a lock; each is served by a partial index over the rows it reads
// (pending, parked, failed) or by a bounded range of the primary key, so
// its cost follows the backlog, not the table.

// EventState names a set of events for Events.
type EventState string

const (
	StatePending    EventState = "pending"    // neither dispatched nor parked
	StateHeld       EventState = "held"       // pending, held by a permanent failure until retried or parked
	StateRetrying   EventState = "retrying"   // pending, backing off after a transient failure until RetryAt
	StateScheduled  EventState = "scheduled"  // pending, waiting for its deliver-at time
	StateStuck      EventState = "stuck"      // pending for longer than EventsOptions.StuckAfter, or held
	StateParked     EventState = "parked"     // set aside by an operator
	StateDispatched EventState = "dispatched" // published; listed newest first
)

// EventStates lists every state, in the order a console shows them.
var EventStates = []EventState{StateStuck, StateHeld, StateRetrying, StateScheduled, StatePending, StateParked, StateDispatched}

// Limits of Events.
const (
	DefaultEventsLimit = 50
	MaxEventsLimit     = 1000
)

// EventsOptions says which events Events lists. Set filters combine with AND.
type EventsOptions struct {
	State EventState // required
	// StuckAfter is the age from which a pending event is stuck, for
	// StateStuck; default store.DefaultStuckAge.
	StuckAfter    time.Duration
	Type          string    // exact event type
	AggregateID   string    // the aggregate key
	CreatedAfter  time.Time // created at or after
	CreatedBefore time.Time // created before
	// Error matches events whose last error contains it, ignoring case.
	Error string
	// Fingerprint matches events whose last error has this fingerprint
	// (FailureGroup.Fingerprint).
	Fingerprint string
	// After continues a listing past the event at this seq: the next page
	// starts after the last seq of the previous one. Events are listed in
	// seq order, oldest first, except StateDispatched, newest first.
	After int64
	Limit int // default DefaultEventsLimit, at most MaxEventsLimit
}

// EventInfo is one event as a listing shows it.
type EventInfo struct {
	Seq          int64  // position in the table
	ID           string // identity, a UUID
	AggregateID  string
	Type         string
	CreatedAt    time.Time
	DispatchedAt time.Time // zero unless dispatched
	Attempts     int       // failed publish attempts
	LastError    string    // reason of the last failed attempt; empty if none
	FailedAt     time.Time // when the last attempt failed; zero if none
	// RetryAt is when a transiently failed event may be tried again; zero
	// when it has not failed, is held or has gone out.
	RetryAt time.Time
	// DeliverAt is the producer's deliver-at time while the event still
	// waits for it (Scheduled); zero otherwise.
	DeliverAt    time.Time
	Scheduled    bool
	Held         bool
	ParkedAt     time.Time
	ParkedReason string
	// HeldBack counts later pending events of the same aggregate that
	// ordered mode keeps waiting behind this pending event: all of them
	// when it is not due yet (held, retrying, scheduled), else those before
	// the aggregate's next event that is not due.
	HeldBack int64
	// WaitsFor is the event this one waits for in ordered mode: the
	// earliest earlier event of its aggregate that is not due yet, else,
	// when this one is due, the earliest earlier pending event; zero when
	// it waits for nothing but its own time.
	WaitsFor int64
}

// State returns the event's state: dispatched, parked, held, scheduled,
// retrying or pending (a stuck event is held, retrying or pending).
func (e EventInfo) State() EventState {
	switch {
	case !e.DispatchedAt.IsZero():
		return StateDispatched
	case !e.ParkedAt.IsZero():
		return StateParked
	case e.Held:
		return StateHeld
	case e.Scheduled:
		return StateScheduled
	case !e.RetryAt.IsZero():
		return StateRetrying
	}
	return StatePending
}

// infoCols are the columns scanInfo reads, for the outbox row aliased o.
func (s *Admin) infoCols() string {
	t := s.n.Outbox
	return `o.seq, o.event_id::text, o.aggregate_id::text, o.type, o.created_at, o.dispatched_at, o.attempts,
       COALESCE(o.last_error, ''), o.failed_at, o.retry_at, o.parked_at, COALESCE(o.parked_reason, ''),
       ` + aggregateCols(t) + `,
       o.deliver_at, o.dispatched_at IS NULL AND o.parked_at IS NULL AND ` + store.ScheduledSQL
}

func scanInfo(row pgx.Row, extra ...any) (EventInfo, error) {
	var (
		e                               EventInfo
		dispatched, failed, retry, park pgtype.Timestamptz
		waitsFor                        *int64
		deliverAt                       pgtype.Timestamptz
	)
	dest := append([]any{&e.Seq, &e.ID, &e.AggregateID, &e.Type, &e.CreatedAt, &dispatched, &e.Attempts,
		&e.LastError, &failed, &retry, &park, &e.ParkedReason, &e.HeldBack, &waitsFor, &deliverAt, &e.Scheduled}, extra...)
	if err := row.Scan(dest...); err != nil {
		return EventInfo{}, err
	}
	e.DispatchedAt, e.FailedAt, e.ParkedAt = dispatched.Time, failed.Time, park.Time
	switch {
	case e.DispatchedAt.IsZero() && retry.Valid && retry.InfinityModifier == pgtype.Infinity:
		e.Held = true
	case e.Scheduled:
		e.DeliverAt = deliverAt.Time
	case e.DispatchedAt.IsZero() && retry.Valid && retry.InfinityModifier == pgtype.Finite:
		e.RetryAt = retry.Time
	}
	if waitsFor != nil {
		e.WaitsFor = *waitsFor
	}
	return e, nil
}

// fingerprint is the SQL expression of an error's fingerprint: its text
// with what varies between occurrences of one failure (UUIDs, hex and
// decimal numbers, quoted values) replaced by placeholders, so "event 12:
// topic "a" not found" and "event 13: topic "b" not found" group together.
func fingerprint(col string) string {
	e := "COALESCE(" + col + ", '')"
	for _, r := range []struct{ re, with string }{
		{`[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}`, "<uuid>"},
		{`"[^"]*"`, `"…"`},
		{`'[^']*'`, `'…'`},
		{`\m0x[0-9a-f]+\M`, "<hex>"},
		{`[0-9]+(\.[0-9]+)?`, "<n>"},
	} {
		e = "regexp_replace(" + e + ", '" + strings.ReplaceAll(r.re, "'", "''") + "', '" + strings.ReplaceAll(r.with, "'", "''") + "', 'gi')"
	}
	return "left(" + e + ", 300)"
}

// filters returns the SQL conditions of q's filters on the row aliased o,
// with arguments numbered from $next.
func (q EventsOptions) filters(next int) ([]string, []any, error) {
	var (
		conds []string
		args  []any
	)
	param := func(v any) string {
		args = append(args, v)
		return "$" + strconv.Itoa(next+len(args)-1)
	}
	if q.Type != "" {
		conds = append(conds, "o.type = "+param(q.Type))
	}
	if q.AggregateID != "" {
		if err := event.CheckKey(q.AggregateID); err != nil {
			return nil, nil, invalid("aggregate id %q %w", event.Truncate(q.AggregateID, 64), err)
		}
		conds = append(conds, "o.aggregate_id = "+param(q.AggregateID))
	}
	if !q.CreatedAfter.IsZero() && !q.CreatedBefore.IsZero() && !q.CreatedBefore.After(q.CreatedAfter) {
		return nil, nil, invalid("created-before is not after created-after")
	}
	if !q.CreatedAfter.IsZero() {
		conds = append(conds, "o.created_at >= "+param(q.CreatedAfter))
	}
	if !q.CreatedBefore.IsZero() {
		conds = append(conds, "o.created_at < "+param(q.CreatedBefore))
	}
	if q.Error != "" {
		conds = append(conds, "strpos(lower(o.last_error), lower("+param(q.Error)+")) > 0")
	}
	if q.Fingerprint != "" {
		conds = append(conds, "o.last_error IS NOT NULL AND "+fingerprint("o.last_error")+" = "+param(q.Fingerprint))
	}
	return conds, args, nil
}

// DispatchedScanRows bounds the rows a filtered listing of dispatched
// events walks for one page: the filters have no index over dispatched
// rows, so without a bound a filter that matches little would read the
// whole table, newest to oldest. A page that ends short of its limit at
// the bound says where the next one starts (EventsPage.NextAfter).
const DispatchedScanRows = 100_000

// dispatchedScanRows is DispatchedScanRows, smaller in tests.
var dispatchedScanRows int64 = DispatchedScanRows

// EventsPage is one page of a listing.
type EventsPage struct {
	Events []EventInfo
	// NextAfter is EventsOptions.After for the next page; 0 on the last.
	NextAfter int64
}

// Events lists the events in q.State that match q's filters, a page at a
// time (see EventsOptions.After).
func (s *Admin) Events(ctx context.Context, q EventsOptions) ([]EventInfo, error) {
	p, err := s.EventsPage(ctx, q)
	return p.Events, err
}

// EventsPage is Events with where the next page starts.
func (s *Admin) EventsPage(ctx context.Context, q EventsOptions) (EventsPage, error) {
	out, lo, err := s.events(ctx, q)
	if err != nil {
		return EventsPage{}, err
	}
	limit := q.Limit
	if limit == 0 {
		limit = DefaultEventsLimit
	}
	p := EventsPage{Events: out}
	switch {
	case len(out) == limit:
		p.NextAfter = out[len(out)-1].Seq
	case lo > 1:
		p.NextAfter = lo // the scan stopped at its bound: older rows are on the next page
	}
	return p, nil
}

// events runs the listing; lo is the lowest seq a bounded scan of
// dispatched events looked at (0 when the scan was not bounded).
func (s *Admin) events(ctx context.Context, q EventsOptions) (out []EventInfo, lo int64, err error) {
	switch {
	case q.Limit < 0 || q.Limit > MaxEventsLimit:
		return nil, 0, invalid("list events: limit %d is not between 1 and %d", q.Limit, MaxEventsLimit)
	case q.StuckAfter < 0:
		return nil, 0, invalid("list events: StuckAfter %v is negative", q.StuckAfter)
	case q.After < 0:
		return nil, 0, invalid("list events: After %d is negative", q.After)
	}
	if q.Limit == 0 {
		q.Limit = DefaultEventsLimit
	}
	if q.StuckAfter == 0 {
		q.StuckAfter = store.DefaultStuckAge
	}
	const pending = "o.dispatched_at IS NULL AND o.parked_at IS NULL"
	// Each state's condition lets PostgreSQL use the partial index of its
	// rows: pending (seq), parked (seq), dispatched (the primary key).
	var state string
	args := []any{q.After, q.Limit}
	order := "o.seq"
	cursor := "o.seq > $1"
	switch q.State {
	case StatePending:
		state = pending
	case StateHeld:
		state = pending + " AND o.retry_at = 'infinity'"
	case StateRetrying:
		state = pending + " AND o.retry_at > now() AND o.retry_at < 'infinity' AND NOT " + store.ScheduledSQL
	case StateScheduled:
		state = pending + " AND " + store.ScheduledSQL
	case StateStuck:
		// A scheduled event is not stuck for waiting as asked: its age
		// counts from its deliver-at time, as in Stuck and Status.
		state = pending + " AND ((" + store.DueSQL + " < now() - make_interval(secs => $3) AND NOT " + store.ScheduledSQL + ") OR o.retry_at = 'infinity')"
		args = append(args, q.StuckAfter.Seconds())
	case StateParked:
		state = "o.dispatched_at IS NULL AND o.parked_at IS NOT NULL"
	case StateDispatched:
		state = "o.dispatched_at IS NOT NULL"
		order, cursor = "o.seq DESC", "($1::bigint = 0 OR o.seq < $1::bigint)" // seq is a bigint: so is the cursor
	default:
		return nil, 0, invalid("list events: state %q is not one of %s", q.State, statesList())
	}
	conds, fargs, err := q.filters(len(args) + 1)
	if err != nil {
		return nil, 0, fmt.Errorf("list events: %w", err)
	}
	args = append(args, fargs...)
	if q.State == StateDispatched && len(conds) > 0 {
		hi := q.After
		if hi == 0 {
			if err := s.pool.QueryRow(ctx, `SELECT coalesce(max(seq), 0) + 1 FROM `+s.n.Outbox).Scan(&hi); err != nil {
				return nil, 0, fmt.Errorf("list dispatched events: newest seq: %w", err)
			}
		}
		lo = max(hi-dispatchedScanRows, 1)
		args[0] = hi
		args = append(args, lo)
		cursor = fmt.Sprintf("o.seq < $1::bigint AND o.seq >= $%d::bigint", len(args))
	}
	where := strings.Join(append([]string{state, cursor}, conds...), " AND ")
	sql := `SELECT ` + s.infoCols() + ` FROM ` + s.n.Outbox + ` o WHERE ` + where + ` ORDER BY ` + order + ` LIMIT $2`
	rows, err := s.pool.Query(ctx, sql, args...)
	if err != nil {
		return nil, 0, fmt.Errorf("list %s events: %w", q.State, err)
	}
	defer rows.Close()
	for rows.Next() {
		e, err := scanInfo(rows)
		if err != nil {
			return nil, 0, fmt.Errorf("list %s events: scan: %w", q.State, err)
		}
		out = append(out, e)
	}
	if err := rows.Err(); err != nil {
		return nil, 0, fmt.Errorf("list %s events: %w", q.State, err)
	}
	return out, lo, nil
}

func statesList() string {
	names := make([]string, len(EventStates))
	for i, s := range EventStates {
		names[i] = string(s)
	}
	return strings.Join(names, ", ")
}

// ErrEventNotFound is returned by Event for a seq or event id not in the table.
var ErrEventNotFound = errors.New("event not found")

// NeighbourWindow bounds how far, in seqs, Event looks either side of
// an event for the other events of its aggregate: the table has no index
// over all of an aggregate's rows (only its pending ones), so the search
// walks the primary key and must stop. Pending events of the aggregate are
// found wherever they are.
const NeighbourWindow = 10000

// EventDetail is one event with its content and its aggregate's
// neighbours.
type EventDetail struct {
	EventInfo
	// Payload is the payload as the producer wrote it: JSON, or the bytes
	// of ContentType (empty for application/json).
	Payload     []byte
	ContentType string
	Headers     []byte // the headers column's text, JSON; nil when NULL
	// Before and After are the nearest events of the same aggregate, up to
	// Neighbours on each side, in seq order: pending ones wherever they
	// are, the others within NeighbourWindow rows.
	Before, After []EventInfo
}

// Neighbours is how many events Event returns on each side.
const Neighbours = 5

// Event returns the event at seq, or with the event id id when seq is
// zero, wrapping ErrEventNotFound when there is none.
func (s *Admin) Event(ctx context.Context, seq int64, id string) (EventDetail, error) {
	var (
		cond string
		arg  any
	)
	switch {
	case seq > 0:
		cond, arg = "o.seq = $1", seq
	case seq == 0 && id != "":
		u, err := uuid.Parse(id)
		if err != nil {
			return EventDetail{}, invalid("read event: event id %q is not a UUID", id)
		}
		cond, arg = "o.event_id = $1::uuid", u.String()
	default:
		return EventDetail{}, invalid("read event: seq %d is not a valid event position", seq)
	}
	var (
		d           EventDetail
		payload     *string
		payloadB    []byte
		contentType *string
		headers     *string
	)
	row := s.pool.QueryRow(ctx, `SELECT `+s.infoCols()+`, o.payload::text, o.payload_bytes, o.content_type, o.headers::text FROM `+
		s.n.Outbox+` o WHERE `+cond, arg)
	info, err := scanInfo(row, &payload, &payloadB, &contentType, &headers)
	if errors.Is(err, pgx.ErrNoRows) {
		return EventDetail{}, fmt.Errorf("read event %v: %w", arg, ErrEventNotFound)
	}
	if err != nil {
		return EventDetail{}, fmt.Errorf("read event %v: %w", arg, err)
	}
	d.EventInfo, d.Payload = info, payloadB
	if payload != nil {
		d.Payload = []byte(*payload)
	}
	if contentType != nil {
		d.ContentType = *contentType
	}
	if headers != nil {
		d.Headers = []byte(*headers)
	}
	t := s.n.Outbox
	// The nearest rows of the aggregate either side within the window,
	// and its pending rows through their index; UNION drops the overlap.
	sql := `SELECT ` + s.infoCols() + ` FROM ` + t + ` o WHERE o.seq IN (
    (SELECT seq FROM ` + t + ` WHERE aggregate_id = $1 AND seq < $2 AND seq >= $2 - $3 ORDER BY seq DESC LIMIT $4)
    UNION (SELECT seq FROM ` + t + ` WHERE aggregate_id = $1 AND seq > $2 AND seq <= $2 + $3 ORDER BY seq LIMIT $4)
    UNION (SELECT seq FROM ` + t + ` WHERE aggregate_id = $1 AND seq < $2
           AND dispatched_at IS NULL AND parked_at IS NULL ORDER BY seq DESC LIMIT $4)
    UNION (SELECT seq FROM ` + t + ` WHERE aggregate_id = $1 AND seq > $2
           AND dispatched_at IS NULL AND parked_at IS NULL ORDER BY seq LIMIT $4))
ORDER BY o.seq`
	rows, err := s.pool.Query(ctx, sql, d.AggregateID, d.Seq, NeighbourWindow, Neighbours)
	if err != nil {
		return EventDetail{}, fmt.Errorf("read neighbours of event %d: %w", d.Seq, err)
	}
	defer rows.Close()
	for rows.Next() {
		n, err := scanInfo(rows)
		if err != nil {
			return EventDetail{}, fmt.Errorf("read neighbours of event %d: scan: %w", d.Seq, err)
		}
		if n.Seq < d.Seq {
			d.Before = append(d.Before, n)
		} else {
			d.After = append(d.After, n)
		}
	}
	if err := rows.Err(); err != nil {
		return EventDetail{}, fmt.Errorf("read neighbours of event %d: %w", d.Seq, err)
	}
	// The nearest few on each side: pending ones from further away may
	// have joined the window's.
	if len(d.Before) > Neighbours {
		d.Before = d.Before[len(d.Before)-Neighbours:]
	}
	if len(d.After) > Neighbours {
		d.After = d.After[:Neighbours]
	}
	return d, nil
}

// FailureGroup is the events that have not gone out and whose last
// failure has one error fingerprint.
type FailureGroup struct {
	Fingerprint string // the error with its varying parts replaced (see Events' Fingerprint filter)
	Example     string // the most recent full error of the group
	ExampleSeq  int64  // the event that failed with Example
	Events      int64
	Held        int64 // of Events, held for an operator
	Retrying    int64 // backing off
	Parked      int64 // set aside with the error still recorded
	Types       []string
	// FirstSeen and LastSeen are the earliest and latest of the events'
	// last failed attempts.
	FirstSeen, LastSeen time.Time
}

// MaxFailureGroups bounds the groups Failures returns, largest first.
const MaxFailureGroups = 200

// Failures groups the undispatched events that failed (held, backing off,
// released for a retry not yet made, or parked with their error) by the
// fingerprint of their last error, largest group first.
func (s *Admin) Failures(ctx context.Context) ([]FailureGroup, error) {
	t := s.n.Outbox
	// Two branches, so each finds its rows through its own partial index
	// (pending, parked) instead of a scan for dispatched_at IS NULL.
	sql := `
WITH f AS (
    SELECT seq, type, last_error, failed_at, retry_at, false AS parked FROM ` + t + `
    WHERE dispatched_at IS NULL AND parked_at IS NULL AND last_error IS NOT NULL
    UNION ALL
    SELECT seq, type, last_error, failed_at, retry_at, true FROM ` + t + `
    WHERE dispatched_at IS NULL AND parked_at IS NOT NULL AND last_error IS NOT NULL
), g AS (
    SELECT ` + fingerprint("last_error") + ` AS fp, * FROM f
)
SELECT fp, (array_agg(last_error ORDER BY failed_at DESC NULLS LAST, seq DESC))[1],
       (array_agg(seq ORDER BY failed_at DESC NULLS LAST, seq DESC))[1],
       count(*),
       count(*) FILTER (WHERE NOT parked AND retry_at = 'infinity'),
       count(*) FILTER (WHERE NOT parked AND retry_at > now() AND retry_at < 'infinity'),
       count(*) FILTER (WHERE parked),
       (array_agg(DISTINCT type ORDER BY type))[1:5],
       min(failed_at), max(failed_at)
FROM g GROUP BY fp ORDER BY count(*) DESC, max(failed_at) DESC NULLS LAST LIMIT $1`
	rows, err := s.pool.Query(ctx, sql, MaxFailureGroups)
	if err != nil {
		return nil, fmt.Errorf("group failures: %w", err)
	}
	defer rows.Close()
	var out []FailureGroup
	for rows.Next() {
		var (
			g           FailureGroup
			first, last pgtype.Timestamptz
		)
		if err := rows.Scan(&g.Fingerprint, &g.Example, &g.ExampleSeq, &g.Events, &g.Held, &g.Retrying, &g.Parked,
			&g.Types, &first, &last); err != nil {
			return nil, fmt.Errorf("group failures: scan: %w", err)
		}
		g.FirstSeen, g.LastSeen = first.Time, last.Time
		out = append(out, g)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("group failures: %w", err)
	}
	return out, nil
}

// Minute is the outbox's activity in one minute.
type Minute struct {
	Start      time.Time
	Dispatched int64 // events marked dispatched
	// Failed counts events whose last failed attempt falls in the minute:
	// an event failing every minute counts in its latest minute only.
	Failed int64
}

// MaxActivityMinutes bounds Activity's window (a day).
const MaxActivityMinutes = 24 * 60

// Activity returns the last minutes whole minutes up to now, oldest first,
// with the current minute last. The counts come from the dispatched_at and
// failed_at indexes, so they cost as much as the events of the window.
func (s *Admin) Activity(ctx context.Context, minutes int) ([]Minute, error) {
	if minutes < 1 || minutes > MaxActivityMinutes {
		return nil, invalid("read activity: %d minutes is not between 1 and %d", minutes, MaxActivityMinutes)
	}
	t := s.n.Outbox
	sql := `
WITH b AS (
    SELECT generate_series(date_trunc('minute', now()) - make_interval(mins => $1 - 1),
                           date_trunc('minute', now()), interval '1 minute') AS start
), d AS (
    SELECT date_trunc('minute', dispatched_at) AS m, count(*) AS n FROM ` + t + `
    WHERE dispatched_at >= date_trunc('minute', now()) - make_interval(mins => $1 - 1) GROUP BY 1
), f AS (
    SELECT date_trunc('minute', failed_at) AS m, count(*) AS n FROM ` + t + `
    WHERE failed_at >= date_trunc('minute', now()) - make_interval(mins => $1 - 1) GROUP BY 1
)
SELECT b.start, COALESCE(d.n, 0), COALESCE(f.n, 0)
FROM b LEFT JOIN d ON d.m = b.start LEFT JOIN f ON f.m = b.start
ORDER BY b.start`
	rows, err := s.pool.Query(ctx, sql, minutes)
	if err != nil {
		return nil, fmt.Errorf("read activity: %w", err)
	}
	defer rows.Close()
	out := make([]Minute, 0, minutes)
	for rows.Next() {
		var m Minute
		if err := rows.Scan(&m.Start, &m.Dispatched, &m.Failed); err != nil {
			return nil, fmt.Errorf("read activity: scan: %w", err)
		}
		out = append(out, m)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read activity: %w", err)
	}
	return out, nil
}

// Action is an operator action on selected events.
type Action string

const (
	ActionRetry  Action = "retry"
	ActionPark   Action = "park"
	ActionUnpark Action = "unpark"
	ActionReplay Action = "replay"
)

// Actions lists every action.
var Actions = []Action{ActionRetry, ActionPark, ActionUnpark, ActionReplay}

// MaxReplayCount bounds the count Affected makes for a replay, which,
// unlike the other actions, works through any number of events.
const MaxReplayCount = 1000000

// Affected is what an action would touch.
type Affected struct {
	// Count is how many events the action would touch if run now.
	Count int64
	// More: more events match than one call touches (MaxSelected for
	// retry, park and unpark: run it again for the rest), or, for a replay,
	// than MaxReplayCount, which the count stops at.
	More bool
}

// Affected counts the events that action would touch with sel, changing
// nothing: what an operator confirms before running it. Rows can change
// state between the count and the action, so it is an estimate of the
// moment.
func (s *Admin) Affected(ctx context.Context, action Action, sel Selector) (Affected, error) {
	var state string
	limit := int64(MaxSelected)
	switch action {
	case ActionReplay:
		state, limit = "o.dispatched_at IS NOT NULL", MaxReplayCount
	case ActionRetry, ActionPark, ActionUnpark:
		state = "o.dispatched_at IS NULL AND " + actionStates[action]
	default:
		return Affected{}, invalid("count affected events: action %q is not retry, park, unpark or replay", action)
	}
	cond, args, err := sel.where("o", 2)
	if err != nil {
		return Affected{}, fmt.Errorf("count events to %s: %w", action, err)
	}
	var n int64
	sql := `SELECT count(*) FROM (SELECT 1 FROM ` + s.n.Outbox + ` o WHERE ` + state + ` AND ` + cond + ` LIMIT $1) m`
	if err := s.pool.QueryRow(ctx, sql, append([]any{limit + 1}, args...)...).Scan(&n); err != nil {
		return Affected{}, fmt.Errorf("count events to %s (%s): %w", action, sel, err)
	}
	if n > limit {
		return Affected{Count: limit, More: true}, nil
	}
	return Affected{Count: n}, nil
}
