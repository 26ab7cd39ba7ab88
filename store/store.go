package store

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/core"
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
}

var (
	_ core.Store    = (*Store)(nil)
	_ core.Notifier = (*Store)(nil)
	_ core.Pinger   = (*Store)(nil)
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
	// row twice.
	cols := "id, uid::text, aggregate_id, type, payload, headers, created_at, attempts"
	pending := `dispatched_at IS NULL AND parked_at IS NULL AND (retry_at IS NULL OR retry_at <= now())`
	// Candidates are locked in id order, skipping rows other relays hold.
	// Ordered mode leaves out aggregates whose earliest event waits for a
	// retry. Then, per aggregate in the claim, the first pending event the
	// claim did not get (locked by another relay, or past the batch) blocks
	// the aggregate from that event on. The probe walks the aggregate's
	// index from its earliest pending event and stops there, so its cost
	// follows the batch, however hot an aggregate is and however many
	// dispatched rows the table keeps.
	ordered := `
WITH held AS (
    SELECT DISTINCT aggregate_id FROM ` + n.Outbox + `
    WHERE dispatched_at IS NULL AND parked_at IS NULL AND retry_at IS NOT NULL AND retry_at > now()
), cand AS (
    SELECT ` + cols + ` FROM ` + n.Outbox + `
    WHERE ` + pending + `
      AND aggregate_id NOT IN (SELECT aggregate_id FROM held)
    ORDER BY id
    LIMIT $1
    FOR UPDATE SKIP LOCKED
), gate AS MATERIALIZED (
    SELECT a.aggregate_id, (
        SELECT p.id FROM ` + n.Outbox + ` p
        WHERE p.aggregate_id = a.aggregate_id
          AND p.dispatched_at IS NULL AND p.parked_at IS NULL
          AND p.id NOT IN (SELECT id FROM cand)
        ORDER BY p.id
        LIMIT 1
    ) AS first_out
    FROM (SELECT DISTINCT aggregate_id FROM cand) a
)
SELECT c.id, c.uid, c.aggregate_id::text, c.type, c.payload, c.headers, c.created_at, c.attempts,
       g.first_out IS NULL OR c.id < g.first_out
FROM cand c JOIN gate g ON g.aggregate_id = c.aggregate_id
ORDER BY c.id`
	unordered := `
SELECT id, uid::text, aggregate_id::text, type, payload, headers, created_at, attempts, true
FROM ` + n.Outbox + `
WHERE ` + pending + `
ORDER BY id
LIMIT $1
FOR UPDATE SKIP LOCKED`
	return &Store{
		pool: pool, cfg: cfg, n: n, log: log,
		claimOrdered:   ordered,
		claimUnordered: unordered,
		markDone:       `UPDATE ` + n.Outbox + ` SET dispatched_at = now(), retry_at = NULL WHERE id = ANY($1)`,
		markFailed: `UPDATE ` + n.Outbox + ` AS o
SET attempts = o.attempts + 1, last_error = f.reason, retry_at = COALESCE(f.retry_at, 'infinity')
FROM unnest($1::bigint[], $2::text[], $3::timestamptz[]) AS f(id, reason, retry_at)
WHERE o.id = f.id`,
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
func (s *Store) Claim(ctx context.Context, req core.ClaimRequest) (core.Claim, error) {
	q := s.claimOrdered
	if req.Unordered {
		q = s.claimUnordered
	}
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("begin claim: %w", err)
	}
	rows, err := tx.Query(ctx, q, req.Limit)
	if err != nil {
		_ = tx.Rollback(context.WithoutCancel(ctx))
		return nil, fmt.Errorf("select events: %w", err)
	}
	// Every candidate comes back with whether the gate lets it through; the
	// others stay locked, unpublished, until the claim ends.
	// Limit comes from the caller: a negative one must reach PostgreSQL as
	// an error, a huge one must not allocate up front.
	events := make([]core.Event, 0, min(max(req.Limit, 0), 1000))
	gated := false
	for rows.Next() {
		var e core.Event
		var pass bool
		if err := rows.Scan(&e.ID, &e.UID, &e.AggregateID, &e.Type, &e.Payload, &e.Headers, &e.CreatedAt, &e.Attempts, &pass); err != nil {
			rows.Close()
			_ = tx.Rollback(context.WithoutCancel(ctx))
			return nil, fmt.Errorf("scan event: %w", err)
		}
		if !pass {
			gated = true
			continue
		}
		events = append(events, e)
	}
	if err := rows.Err(); err != nil {
		_ = tx.Rollback(context.WithoutCancel(ctx))
		return nil, fmt.Errorf("select events: %w", err)
	}
	if len(events) == 0 {
		// Hold no transaction for an empty claim.
		if err := tx.Rollback(ctx); err != nil {
			return nil, fmt.Errorf("end empty claim: %w", err)
		}
		return &claim{s: s, gated: gated}, nil
	}
	return &claim{s: s, tx: tx, events: events, gated: gated}, nil
}

type claim struct {
	s      *Store
	tx     pgx.Tx
	events []core.Event
	gated  bool // some candidates wait for other relays' claims
}

var (
	_ core.Claim     = (*claim)(nil)
	_ core.Truncated = (*claim)(nil)
)

func (c *claim) Events() []core.Event { return c.events }

// Truncated implements core.Truncated.
func (c *claim) Truncated() bool { return c.gated }

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
			ids[i] = f.ID
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
