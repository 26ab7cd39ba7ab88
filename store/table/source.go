package table

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store"
)

// Source is the PostgreSQL outbox. It is safe for concurrent use by many
// relays in many processes.
type Source struct {
	pool *pgxpool.Pool
	cfg  store.Config
	n    store.Names
	log  *slog.Logger

	claimAll, claimUnordered string // claimAll: ordered, every partition
	markDone, markFailed     string
	from                     scanFrom
	sleeper                  sleeper
	share                    share
	handOff                  bool // log mode's table path: takes no table-mode lock (see Hold)
}

// scanFrom is where unordered claims start their scan of pending seqs
// while a backlog drains. Marking an event dispatched leaves its entry in
// the pending index until VACUUM, and the relay's other open claims hold
// locked rows there, so a scan from the lowest seq walks every entry
// dispatched since the last VACUUM and every event in flight, and a claim
// slows down with them. While claims come back full, each one starts just
// past the last one's last candidate; every scanFromFor, and after any
// claim that was not full, the scan starts from the bottom again. An
// event that becomes claimable below the start (a producer transaction
// that committed late, an event released by a relay that stopped, a retry
// come due) waits at most that long. Only unordered claims use it: an
// ordered claim must see an aggregate's earliest pending event.
type scanFrom struct {
	mu    sync.Mutex
	id    int64
	since time.Time
}

// scanFromFor bounds how long claims start above the bottom.
const scanFromFor = 250 * time.Millisecond

// get returns the seq to start from; 0 scans from the bottom.
func (f *scanFrom) get() int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.id == 0 || time.Since(f.since) >= scanFromFor {
		return 0
	}
	return f.id
}

// claimed records a claim that started at from, whether its candidates
// filled the batch, and its last candidate's seq.
func (f *scanFrom) claimed(from int64, full bool, last int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	switch {
	case !full:
		f.id = 0
	case from == 0:
		f.id, f.since = last+1, time.Now()
	default:
		f.id = last + 1
	}
}

// maxClaimPasses bounds the scans of one ordered claim (see Claim).
const maxClaimPasses = 8

var (
	_ core.Source        = (*Source)(nil)
	_ core.Notifier      = (*Source)(nil)
	_ core.Pinger        = (*Source)(nil)
	_ core.BacklogReader = (*Source)(nil)
	_ core.Holder        = (*Source)(nil)
)

// New returns a Source over pool. The schema must have been migrated.
// log may be nil.
func New(pool *pgxpool.Pool, cfg store.Config, log *slog.Logger) (*Source, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	n := cfg.Names()
	unordered := `
WITH cand AS MATERIALIZED (
    SELECT ` + claimCols + ` FROM ` + n.Outbox + `
    WHERE ` + claimPending + ` AND seq >= $4
    ORDER BY seq
    LIMIT $1
    FOR UPDATE SKIP LOCKED
), w AS (` + claimRunning + `)
SELECT ` + claimResult("") + `, true
FROM cand c JOIN w ON w.seq = c.seq
ORDER BY c.seq`
	s := &Source{
		pool: pool, cfg: cfg, n: n, log: log,
		claimUnordered: unordered,
		markDone:       `UPDATE ` + n.Outbox + ` SET dispatched_at = now(), retry_at = NULL WHERE seq = ANY($1)`,
		markFailed: `UPDATE ` + n.Outbox + ` AS o
SET attempts = o.attempts + 1, last_error = f.reason, retry_at = COALESCE(f.retry_at, 'infinity'), failed_at = now()
FROM unnest($1::bigint[], $2::text[], $3::timestamptz[]) AS f(seq, reason, retry_at)
WHERE o.seq = f.seq`,
	}
	s.claimAll = s.orderedClaim(nil)
	return s, nil
}

// NewHandOff returns the table source of log mode's table path: over the
// outbox's handoff view (cfg as the log relay's HandOffConfig returns
// it), it claims only the rows the log relay handed off. It is part of
// log mode, so it takes no table-mode lock (see Hold): the log relay
// holds the log-mode lock.
func NewHandOff(pool *pgxpool.Pool, cfg store.Config, log *slog.Logger) (*Source, error) {
	s, err := New(pool, cfg, log)
	if err != nil {
		return nil, err
	}
	s.handOff = true
	return s, nil
}

// Candidates carry every column the relay needs, so no statement reads a
// row twice, and their size, so no oversized payload leaves the server.
const claimCols = "seq, event_id::text AS event_id, aggregate_id, type, payload, payload_bytes, content_type, topic, headers, created_at, attempts," +
	" coalesce(octet_length(payload::text), octet_length(payload_bytes)) + coalesce(octet_length(headers::text), 0) AS size"

const claimPending = `dispatched_at IS NULL AND parked_at IS NULL AND (retry_at IS NULL OR retry_at <= now())`

// claimStillPending is claimPending for looking up rows by seq. Written so
// that it proves none of the partial indexes' predicates, it leaves the
// primary key as the only index to find them by: statistics that say
// nothing is pending once made the planner read a whole partial index
// for the claim's few hundred seqs instead.
const claimStillPending = `coalesce(dispatched_at, parked_at) IS NULL AND (retry_at IS NULL OR retry_at <= now())`

// The result sends a row's payload only when the row fits the event limit
// ($2) and the claim's running total of fitting rows stays within the
// claim limit ($3). An oversized row comes back without its payload, to be
// held; rows past the claim limit come back with within = false and stay
// pending. The first fitting row is always within, so a claim makes
// progress whatever the limits.
const (
	claimWithin  = `(w.total <= $3 OR w.total = c.size)`
	claimRunning = `SELECT seq, sum(CASE WHEN size <= $2 THEN size ELSE 0 END) OVER (ORDER BY seq) AS total FROM cand`
)

// claimResult is the claim's columns; gate, when set, is a condition (and
// AND) a row must meet for its payload to be sent.
func claimResult(gate string) string {
	return `c.seq, c.event_id, c.aggregate_id::text, c.type,
       CASE WHEN ` + gate + `c.size <= $2 AND ` + claimWithin + ` THEN c.payload::text END,
       CASE WHEN ` + gate + `c.size <= $2 AND ` + claimWithin + ` THEN c.payload_bytes END,
       c.content_type, c.topic, c.headers::text, c.created_at, c.attempts, c.size, ` + claimWithin
}

// orderedClaim is the ordered claim over partitions parts, or over every
// partition when parts is nil.
//
// It reads the first $1 pending events in seq order, merging each
// partition's from the partition index, and leaves out two kinds: the
// caller's own in flight ($4: events of its open claims, which it
// publishes first), and the events of an aggregate from its first event
// that is not due yet (waiting for a retry or its deliver-at time) on, or
// from its first event on for the aggregates the caller holds back ($5).
// held has that seq per aggregate, usually few; both sets are hashed, so
// an event the scan steps over costs two lookups. Then it locks what it
// read, skipping rows another session holds: another relay's claim, or one
// of the caller's own whose publish failed. Such a row holds its
// aggregate back from there on: the aggregate's events after it are
// returned as not passing, and stay pending. Every earlier pending event
// of an aggregate lies earlier in the same scan, so an event passes only
// when each one before it is in the claim or in flight. Nothing is looked
// up per aggregate, however hot one is. At most $1 events pass.
//
// The rows it could not lock come back too, as not passing, with their
// seq and aggregate only: the caller learns which aggregates locked rows
// hold back, and that the claim was cut short.
func (s *Source) orderedClaim(parts []int) string {
	if parts != nil && len(parts) == 0 {
		return ""
	}
	scan := func(cond string) string {
		return `(SELECT seq, aggregate_id FROM ` + s.n.Outbox + `
        WHERE ` + cond + claimPending + ` AND seq NOT IN (SELECT seq FROM mine)
          AND (aggregate_id NOT IN (SELECT aggregate_id FROM held)
               OR (seq < (SELECT max(seq) FROM held)
                   AND seq < ((SELECT jsonb_object_agg(aggregate_id, seq) FROM held) ->> aggregate_id)::bigint))
        ORDER BY seq LIMIT $1)`
	}
	var scans []string
	if parts == nil {
		scans = []string{scan("")}
	}
	for _, p := range parts {
		scans = append(scans, scan(fmt.Sprintf("%s = %d AND ", partitionOf, p)))
	}
	return `
WITH held AS MATERIALIZED (
    SELECT aggregate_id, min(seq) AS seq FROM (
        SELECT aggregate_id, seq FROM ` + s.n.Outbox + `
        WHERE dispatched_at IS NULL AND parked_at IS NULL AND retry_at IS NOT NULL AND retry_at > now()
        UNION ALL SELECT unnest($5::text[]), 0
    ) h
    GROUP BY aggregate_id
), mine AS MATERIALIZED (
    SELECT unnest($4::bigint[]) AS seq
), pre AS MATERIALIZED (
    SELECT seq, aggregate_id FROM (
        ` + strings.Join(scans, "\n        UNION ALL ") + `
    ) u
    ORDER BY seq
    LIMIT $1
), cand AS MATERIALIZED (
    SELECT ` + claimCols + ` FROM ` + s.n.Outbox + `
    WHERE seq = ANY (ARRAY(SELECT seq FROM pre)) AND ` + claimStillPending + `
    ORDER BY seq
    FOR UPDATE SKIP LOCKED
), skipped AS MATERIALIZED (
    SELECT seq, aggregate_id FROM pre
    WHERE seq NOT IN (SELECT seq FROM cand)
), gate AS (
    SELECT c.seq, c.size, s.seq IS NULL OR c.seq < s.seq AS passes
    FROM cand c LEFT JOIN (SELECT aggregate_id, min(seq) AS seq FROM skipped GROUP BY aggregate_id) s
        ON s.aggregate_id = c.aggregate_id
), w AS (
    SELECT seq, passes, sum(CASE WHEN passes AND size <= $2 THEN size ELSE 0 END) OVER (ORDER BY seq) AS total
    FROM gate
)
SELECT ` + claimResult("w.passes AND ") + `, w.passes
FROM cand c JOIN w ON w.seq = c.seq
UNION ALL
SELECT seq, '', aggregate_id, '', NULL, NULL, NULL, NULL, NULL, now(), 0, 0, false, false
FROM skipped
ORDER BY 1`
}

// Config returns the source's configuration with defaults filled in.
func (s *Source) Config() store.Config { return s.cfg }

// Pool returns the connection pool the source uses.
func (s *Source) Pool() *pgxpool.Pool { return s.pool }

// Ping implements core.Pinger.
func (s *Source) Ping(ctx context.Context) error {
	if err := s.pool.Ping(ctx); err != nil {
		return fmt.Errorf("ping database: %w", err)
	}
	return nil
}

// Claim implements core.Source. The claim is one transaction holding row
// locks, so a relay that dies mid-batch releases its events at once when its
// connection drops, and the mark commits together with nothing else.
//
// A row's content never fails the claim: a row the relay cannot turn into
// an event (headers that are not an object of strings, a malformed type, a
// size over MaxEventBytes) comes back as a rejection, which the relay holds
// like a permanent publish failure. In ordered mode the later events of its
// aggregate stay out of the claim.
func (s *Source) Claim(ctx context.Context, req core.ClaimOptions) (core.Claim, error) {
	from := s.from.get()
	q, args := s.claimUnordered, []any{req.Limit, s.cfg.MaxEventBytes, s.cfg.MaxClaimBytes, from}
	if !req.Unordered {
		q = s.claimAll
		if o := s.share.owned.Load(); o != nil {
			q = o.claim
		}
		if q == "" {
			return &claim{s: s}, nil // no partition owned
		}
		heldBack := append([]string{}, req.HeldBack...)
		args = []any{req.Limit, s.cfg.MaxEventBytes, s.cfg.MaxClaimBytes, req.InFlight, heldBack}
	}
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("begin claim: %w", err)
	}
	// The planner estimates the claim from the table's statistics, which
	// can be far from the truth. In an outbox they mostly describe
	// dispatched rows, so it can expect one pending row and join the
	// candidates to the gate in nested loops (a claim of a few hundred
	// events took seconds). And a plan made while the table was nearly
	// empty reads it whole, and is kept until the next ANALYZE, so every
	// claim and mark read every row (claims of 50-250ms seconds after a
	// relay started on a new table). The claim reads pending rows through
	// their partial indexes and joins only its own few rows, so these
	// settings hold for its whole transaction, the mark included. The
	// plan's shape does not depend on the arguments, so it is made once
	// per session: planning the ordered claim for every batch took a tenth
	// as long as running it.
	//
	// The transaction's BEGIN, these settings and the claim go in one
	// round trip, as the marks and the COMMIT do at the end: on the way
	// from a commit to the broker the claim is one round trip, not two.
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	b.Queue(`SELECT set_config('enable_nestloop', 'off', true), set_config('enable_seqscan', 'off', true),
       set_config('plan_cache_mode', 'force_generic_plan', true)`)
	b.Queue(q, args...)
	br := conn.SendBatch(ctx, b)
	fail := func(what string, err error) (core.Claim, error) {
		_ = br.Close()
		_ = rollback(context.WithoutCancel(ctx), conn)
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	if _, err := br.Exec(); err != nil {
		return fail("begin claim", err)
	}
	if _, err := br.Exec(); err != nil {
		return fail("set up claim", err)
	}
	rows, err := br.Query()
	if err != nil {
		return fail("select events", err)
	}
	c, st, err := s.readClaim(rows, req)
	if err != nil {
		return fail("select events", err)
	}
	if err := br.Close(); err != nil {
		return fail("select events", err)
	}
	if req.Unordered {
		s.from.claimed(from, st.candidates >= req.Limit, st.last)
	}
	// Rows other transactions hold (a frozen relay's open claims, a
	// stalled aggregate's) and the later events of their aggregates can
	// fill the scan and leave the claim short. Then it scans again, in the
	// same transaction (its own locks do not stop it), leaving those
	// aggregates out, until it is full, meets no locked row, or has made
	// maxClaimPasses scans: it returns the claimable events whatever rows
	// others hold, however many events wait behind them.
	for pass := 1; !req.Unordered && pass < maxClaimPasses && len(st.blocked) > 0 &&
		len(c.events)+len(c.rejected) < req.Limit && st.candidates >= req.Limit; pass++ {
		args[4] = append(args[4].([]string), st.blocked...)
		rows, err := conn.Query(ctx, q, args...)
		if err != nil {
			return fail("select events", err)
		}
		if c, st, err = s.readClaim(rows, req); err != nil {
			return fail("select events", err)
		}
		c.truncated = true // it left the blocked aggregates out
	}
	if len(c.events) == 0 && len(c.rejected) == 0 {
		// Hold no transaction for an empty claim.
		if err := rollback(ctx, conn); err != nil {
			return nil, fmt.Errorf("end empty claim: %w", err)
		}
		return c, nil
	}
	c.conn = conn
	return c, nil
}

// claimRead is what a claim's rows said besides its events.
type claimRead struct {
	candidates int      // rows read
	last       int64    // the last row's seq
	blocked    []string // aggregates of the rows that did not pass the gate
}

// readClaim reads a claim's rows and closes them.
func (s *Source) readClaim(rows pgx.Rows, req core.ClaimOptions) (*claim, claimRead, error) {
	defer rows.Close()
	// Limit comes from the caller: a negative one must reach PostgreSQL as
	// an error. Most claims at a steady rate find a few events or none, so
	// only a few are allocated up front: a claim's full limit, zeroed for
	// every claim, cost more than the claim itself; append grows it.
	c := &claim{s: s, events: make([]core.Event, 0, min(max(req.Limit, 0), 16))}
	var st claimRead
	var rejectedAggs map[string]bool
	// One set of scan destinations for the whole claim: taking their
	// addresses per row would allocate each of them for every event.
	var (
		r              store.Row
		within, passes bool
	)
	dest := []any{&r.Seq, &r.ID, &r.AggregateID, &r.Type, &r.Payload, &r.PayloadBytes, &r.ContentType, &r.Topic, &r.Headers,
		&r.CreatedAt, &r.Attempts, &r.Size, &within, &passes}
	for rows.Next() {
		// Cleared, so that no row's values can share memory with the last.
		r = store.Row{}
		if err := rows.Scan(dest...); err != nil {
			return nil, st, fmt.Errorf("scan event: %w", err)
		}
		st.candidates++
		st.last = r.Seq
		// Rows the gate or the claim's byte limit leave out stay locked,
		// unpublished, until the claim ends.
		if !passes || !within {
			c.truncated = true
			if !passes {
				st.blocked = append(st.blocked, r.AggregateID)
			}
			continue
		}
		if !req.Unordered && rejectedAggs[r.AggregateID] {
			c.truncated = true
			continue
		}
		e, err := r.Event(s.cfg.MaxEventBytes)
		if err != nil {
			c.rejected = append(c.rejected, core.Rejection{Event: e, Err: err})
			if rejectedAggs == nil {
				rejectedAggs = map[string]bool{}
			}
			rejectedAggs[e.AggregateID] = true
			continue
		}
		c.events = append(c.events, e)
	}
	return c, st, rows.Err()
}

// rollback ends conn's transaction and returns conn to the pool. The pool
// closes a connection left in a transaction rather than reuse it, so a
// rollback that fails loses nothing but the connection.
func rollback(ctx context.Context, conn *pgxpool.Conn) error {
	_, err := conn.Exec(ctx, "ROLLBACK")
	conn.Release()
	return err
}

type claim struct {
	s         *Source
	conn      *pgxpool.Conn // in the claim's transaction; nil once it ended
	events    []core.Event
	rejected  []core.Rejection
	truncated bool // some candidates were left out and stay pending
}

var (
	_ core.Claim     = (*claim)(nil)
	_ core.Truncated = (*claim)(nil)
	_ core.Rejecter  = (*claim)(nil)
)

func (c *claim) Events() []core.Event { return c.events }

// Rejected implements core.Rejecter.
func (c *claim) Rejected() []core.Rejection { return c.rejected }

// Truncated implements core.Truncated.
func (c *claim) Truncated() bool { return c.truncated }

func (c *claim) Complete(ctx context.Context, done []int64, failed []core.Failure) error {
	if c.conn == nil {
		return nil
	}
	conn := c.conn
	c.conn = nil
	b := &pgx.Batch{}
	if len(done) > 0 {
		b.Queue(c.s.markDone, done)
	}
	if len(failed) > 0 {
		ids := make([]int64, len(failed))
		reasons := make([]string, len(failed))
		retry := make([]*time.Time, len(failed))
		for i, f := range failed {
			ids[i] = f.Seq
			reasons[i] = store.Reason(f.Reason)
			if !f.RetryAt.IsZero() {
				t := f.RetryAt
				retry[i] = &t
			}
		}
		b.Queue(c.s.markFailed, ids, reasons, retry)
	}
	marks := b.Len()
	b.Queue("COMMIT")
	br := conn.SendBatch(ctx, b)
	for range marks {
		if _, err := br.Exec(); err != nil {
			_ = br.Close()
			_ = rollback(context.WithoutCancel(ctx), conn)
			return fmt.Errorf("record outcome: %w", err)
		}
	}
	// A failed mark keeps the COMMIT after it from running. A COMMIT of a
	// transaction that failed earlier rolls back and answers ROLLBACK:
	// nothing was recorded then.
	tag, err := br.Exec()
	if err == nil && tag.String() != "COMMIT" {
		err = fmt.Errorf("the transaction ended with %s", tag)
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	conn.Release()
	if err != nil {
		return fmt.Errorf("commit outcome: %w", err)
	}
	return nil
}

func (c *claim) Release(ctx context.Context) error {
	if c.conn == nil {
		return nil
	}
	conn := c.conn
	c.conn = nil
	if err := rollback(ctx, conn); err != nil {
		return fmt.Errorf("release claim: %w", err)
	}
	return nil
}
