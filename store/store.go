package store

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/event"
)

// maxReason bounds the stored failure reason.
const maxReason = 2000

// Store is the PostgreSQL outbox. It is safe for concurrent use by many
// relays in many processes.
type Store struct {
	pool *pgxpool.Pool
	cfg  Config
	n    names
	log  *slog.Logger

	claimOrdered, claimUnordered string
	markDone, markFailed         string
	from                         scanFrom
	sleeper                      sleeper
}

// scanFrom is where claims start their scan of pending seqs while a
// backlog drains. Marking an event dispatched leaves its entry in the
// pending index until VACUUM, so a scan from the lowest seq walks every
// entry dispatched since the last one, and a claim over a large drained
// backlog slows down with it. While claims come back full, each one starts
// at the first seq the last full scan from the bottom found; every
// scanFromFor, and after any claim that was not full, the scan starts from
// the bottom again. An event that becomes claimable below the start (a
// producer transaction that committed late, an event released by a relay
// that stopped, a retry come due) waits at most that long, and the ordered
// gate, which never uses the start, keeps its aggregate's later events
// back meanwhile: the start only ever delays, never reorders or skips.
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
// filled the batch, and its first candidate's seq.
func (f *scanFrom) claimed(from int64, full bool, first int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	switch {
	case !full:
		f.id = 0
	case from == 0:
		f.id, f.since = first, time.Now()
	}
}

var (
	_ core.Store         = (*Store)(nil)
	_ core.Notifier      = (*Store)(nil)
	_ core.Pinger        = (*Store)(nil)
	_ core.BacklogReader = (*Store)(nil)
)

// New returns a Store over pool. The schema must have been migrated.
// log may be nil.
func New(pool *pgxpool.Pool, cfg Config, log *slog.Logger) (*Store, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	n := cfg.names()
	// Candidates carry every column the relay needs, so no statement reads a
	// row twice, and their size, so no oversized payload leaves the server.
	cols := "seq, event_id::text AS event_id, aggregate_id, type, payload, payload_bytes, content_type, topic, headers, created_at, attempts," +
		" coalesce(octet_length(payload::text), octet_length(payload_bytes)) + coalesce(octet_length(headers::text), 0) AS size"
	pending := `dispatched_at IS NULL AND parked_at IS NULL AND (retry_at IS NULL OR retry_at <= now())`
	// The result sends a row's payload only when the row fits the event
	// limit ($2) and the claim's running total of fitting rows stays within
	// the claim limit ($3). An oversized row comes back without its payload,
	// to be held; rows past the claim limit come back with within = false
	// and stay pending.
	// The first fitting row is always within, so a claim makes progress
	// whatever the limits.
	within := `(w.total <= $3 OR w.total = c.size)`
	result := `c.seq, c.event_id, c.aggregate_id::text, c.type,
       CASE WHEN c.size <= $2 AND ` + within + ` THEN c.payload::text END,
       CASE WHEN c.size <= $2 AND ` + within + ` THEN c.payload_bytes END,
       c.content_type, c.topic, c.headers::text, c.created_at, c.attempts, c.size, ` + within
	running := `SELECT seq, sum(CASE WHEN size <= $2 THEN size ELSE 0 END) OVER (ORDER BY seq) AS total FROM cand`
	// Candidates are locked in seq order, skipping rows other relays hold.
	// Ordered mode leaves out the events of an aggregate from its first
	// event that is not due yet (waiting for a retry or its deliver-at
	// time) on: held has that seq per aggregate, usually few, and early
	// the aggregate's pending events before it, at most a batch of them
	// each, found through the (aggregate_id, seq) index. Both are hashed
	// sets, so an event the scan steps over costs two lookups however many
	// events wait. Then, per aggregate in the claim, the first pending event
	// neither in the claim nor in the caller's in-flight list ($5: events
	// of its own open claims, which it publishes first) blocks the
	// aggregate from that event on: one not due yet, one locked by another
	// relay, one past the batch, or one of the caller's whose publish
	// failed. The probe walks the aggregate's index from its earliest
	// pending event and stops there, so its cost follows the batch, however
	// hot an aggregate is and however many dispatched rows the table keeps.
	ordered := `
WITH held AS MATERIALIZED (
    SELECT aggregate_id, min(seq) AS seq FROM ` + n.Outbox + `
    WHERE dispatched_at IS NULL AND parked_at IS NULL AND retry_at IS NOT NULL AND retry_at > now()
    GROUP BY aggregate_id
), cand AS MATERIALIZED (
    SELECT ` + cols + ` FROM ` + n.Outbox + `
    WHERE ` + pending + ` AND seq >= $4
      AND (aggregate_id NOT IN (SELECT aggregate_id FROM held)
           OR (seq < (SELECT max(seq) FROM held)
               AND seq < ((SELECT jsonb_object_agg(aggregate_id, seq) FROM held) ->> aggregate_id)::bigint))
    ORDER BY seq
    LIMIT $1
    FOR UPDATE SKIP LOCKED
), mine AS MATERIALIZED (
    SELECT seq FROM cand UNION ALL SELECT unnest($5::bigint[])
), gate AS MATERIALIZED (
    SELECT a.aggregate_id, (
        SELECT p.seq FROM ` + n.Outbox + ` p
        WHERE p.aggregate_id = a.aggregate_id
          AND p.dispatched_at IS NULL AND p.parked_at IS NULL
          AND p.seq NOT IN (SELECT seq FROM mine)
        ORDER BY p.seq
        LIMIT 1
    ) AS first_out
    FROM (SELECT DISTINCT aggregate_id FROM cand) a
), w AS (` + running + `)
SELECT ` + result + `,
       g.first_out IS NULL OR c.seq < g.first_out
FROM cand c JOIN gate g ON g.aggregate_id = c.aggregate_id JOIN w ON w.seq = c.seq
ORDER BY c.seq`
	unordered := `
WITH cand AS MATERIALIZED (
    SELECT ` + cols + ` FROM ` + n.Outbox + `
    WHERE ` + pending + ` AND seq >= $4
    ORDER BY seq
    LIMIT $1
    FOR UPDATE SKIP LOCKED
), w AS (` + running + `)
SELECT ` + result + `, true
FROM cand c JOIN w ON w.seq = c.seq
ORDER BY c.seq`
	return &Store{
		pool: pool, cfg: cfg, n: n, log: log,
		claimOrdered:   ordered,
		claimUnordered: unordered,
		markDone:       `UPDATE ` + n.Outbox + ` SET dispatched_at = now(), retry_at = NULL WHERE seq = ANY($1)`,
		markFailed: `UPDATE ` + n.Outbox + ` AS o
SET attempts = o.attempts + 1, last_error = f.reason, retry_at = COALESCE(f.retry_at, 'infinity'), failed_at = now()
FROM unnest($1::bigint[], $2::text[], $3::timestamptz[]) AS f(seq, reason, retry_at)
WHERE o.seq = f.seq`,
	}, nil
}

// Config returns the store's configuration with defaults filled in.
func (s *Store) Config() Config { return s.cfg }

// Pool returns the connection pool the store uses.
func (s *Store) Pool() *pgxpool.Pool { return s.pool }

// Ping implements core.Pinger.
func (s *Store) Ping(ctx context.Context) error {
	if err := s.pool.Ping(ctx); err != nil {
		return fmt.Errorf("ping database: %w", err)
	}
	return nil
}

// Claim implements core.Store. The claim is one transaction holding row
// locks, so a relay that dies mid-batch releases its events at once when its
// connection drops, and the mark commits together with nothing else.
//
// A row's content never fails the claim: a row the relay cannot turn into
// an event (headers that are not an object of strings, a malformed type, a
// size over MaxEventBytes) comes back as a rejection, which the relay holds
// like a permanent publish failure. In ordered mode the later events of its
// aggregate stay out of the claim.
func (s *Store) Claim(ctx context.Context, req core.ClaimOptions) (core.Claim, error) {
	from := s.from.get()
	q, args := s.claimOrdered, []any{req.Limit, s.cfg.MaxEventBytes, s.cfg.MaxClaimBytes, from, req.InFlight}
	if req.Unordered {
		q, args = s.claimUnordered, args[:4]
	}
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("begin claim: %w", err)
	}
	// The planner estimates the claim's CTEs from the table's statistics,
	// which in an outbox mostly describe dispatched rows: it can expect one
	// pending row and join the candidates to the gate in nested loops,
	// which turns a claim of a few hundred events into seconds. The joins
	// are over the claim's own few rows, so hashing them is always fine.
	// Both statements go in one round trip.
	b := &pgx.Batch{}
	b.Queue(`SET LOCAL enable_nestloop = off`)
	b.Queue(q, args...)
	br := tx.SendBatch(ctx, b)
	if _, err := br.Exec(); err != nil {
		_ = br.Close()
		_ = tx.Rollback(context.WithoutCancel(ctx))
		return nil, fmt.Errorf("set up claim: %w", err)
	}
	rows, err := br.Query()
	if err != nil {
		_ = br.Close()
		_ = tx.Rollback(context.WithoutCancel(ctx))
		return nil, fmt.Errorf("select events: %w", err)
	}
	// Limit comes from the caller: a negative one must reach PostgreSQL as
	// an error, a huge one must not allocate up front.
	c := &claim{s: s, events: make([]core.Event, 0, min(max(req.Limit, 0), 1000))}
	var rejectedAggs map[string]bool
	candidates, first := 0, int64(0)
	for rows.Next() {
		var (
			e                  core.Event
			bytes              []byte
			contentType, topic *string
			headers            *string
			size               int64
			within, passes     bool
		)
		if err := rows.Scan(&e.Seq, &e.ID, &e.AggregateID, &e.Type, &e.Payload, &bytes, &contentType, &topic, &headers,
			&e.CreatedAt, &e.Attempts, &size, &within, &passes); err != nil {
			rows.Close()
			_ = br.Close()
			_ = tx.Rollback(context.WithoutCancel(ctx))
			return nil, fmt.Errorf("scan event: %w", err)
		}
		if candidates == 0 {
			first = e.Seq
		}
		candidates++
		// Rows the gate or the claim's byte limit leave out stay locked,
		// unpublished, until the claim ends.
		if !passes || !within {
			c.truncated = true
			continue
		}
		// One of the two payload columns is set (the table checks it).
		if e.Payload == nil {
			e.Payload = bytes
		}
		if contentType != nil {
			e.ContentType = *contentType
		}
		if topic != nil {
			e.Topic = *topic
		}
		if !req.Unordered && rejectedAggs[e.AggregateID] {
			c.truncated = true
			continue
		}
		if err := s.decode(&e, headers, size); err != nil {
			e.Payload = nil
			c.rejected = append(c.rejected, core.Rejection{Event: e, Err: err})
			if rejectedAggs == nil {
				rejectedAggs = map[string]bool{}
			}
			rejectedAggs[e.AggregateID] = true
			continue
		}
		c.events = append(c.events, e)
	}
	if err := rows.Err(); err != nil {
		_ = br.Close()
		_ = tx.Rollback(context.WithoutCancel(ctx))
		return nil, fmt.Errorf("select events: %w", err)
	}
	if err := br.Close(); err != nil {
		_ = tx.Rollback(context.WithoutCancel(ctx))
		return nil, fmt.Errorf("select events: %w", err)
	}
	s.from.claimed(from, candidates >= req.Limit, first)
	if len(c.events) == 0 && len(c.rejected) == 0 {
		// Hold no transaction for an empty claim.
		if err := tx.Rollback(ctx); err != nil {
			return nil, fmt.Errorf("end empty claim: %w", err)
		}
		return c, nil
	}
	c.tx = tx
	return c, nil
}

// decode checks what the query could not: the parts of a row a broker
// message is made of (event.CheckRow). A JSON payload is in a JSON column,
// so PostgreSQL has already checked it; other payloads are bytes to pass
// on as they are.
func (s *Store) decode(e *core.Event, headers *string, size int64) error {
	h, err := event.CheckRow(e.Type, headers, size, s.cfg.MaxEventBytes)
	e.Headers = h
	if err != nil {
		return err
	}
	if e.Payload == nil {
		// The row grew past the limit between the two checks: impossible
		// in one statement, but never publish an empty payload.
		return errors.New("payload was not read")
	}
	return nil
}

type claim struct {
	s         *Store
	tx        pgx.Tx
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
	if c.tx == nil {
		return nil
	}
	tx := c.tx
	c.tx = nil
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
			reasons[i] = truncate(f.Reason, maxReason)
			if !f.RetryAt.IsZero() {
				t := f.RetryAt
				retry[i] = &t
			}
		}
		b.Queue(c.s.markFailed, ids, reasons, retry)
	}
	if b.Len() > 0 {
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
			return fmt.Errorf("record outcome: %w", err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("commit outcome: %w", err)
	}
	return nil
}

func (c *claim) Release(ctx context.Context) error {
	if c.tx == nil {
		return nil
	}
	tx := c.tx
	c.tx = nil
	if err := tx.Rollback(ctx); err != nil {
		return fmt.Errorf("release claim: %w", err)
	}
	return nil
}

// truncate cuts s to at most n bytes without splitting a UTF-8 sequence.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && s[n]&0xC0 == 0x80 {
		n--
	}
	return s[:n]
}
