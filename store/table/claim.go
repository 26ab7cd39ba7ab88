package table

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store"
)

// maxClaimPasses bounds the scans of one ordered claim (see Claim).
const maxClaimPasses = 8

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
	q, args := s.claimQuery(req, from)
	if q == "" {
		return &claim{s: s}, nil // no partition owned
	}
	conn, br, err := s.begin(ctx, q, args)
	if err != nil {
		return nil, err
	}
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

// claimQuery picks the claim's statement and arguments: the unordered
// claim from seq from, or the ordered one over the partitions the source
// owns. The statement is empty when it owns none.
func (s *Source) claimQuery(req core.ClaimOptions, from int64) (string, []any) {
	if req.Unordered {
		return s.claimUnordered, []any{req.Limit, s.cfg.MaxEventBytes, s.cfg.MaxClaimBytes, from}
	}
	q := s.claimAll
	if o := s.share.owned.Load(); o != nil {
		q = o.claim
	}
	heldBack := append([]string{}, req.HeldBack...)
	return q, []any{req.Limit, s.cfg.MaxEventBytes, s.cfg.MaxClaimBytes, req.InFlight, heldBack}
}

// begin acquires a connection and sends the claim's transaction, its
// settings and q in one batch, whose results the caller reads in turn.
func (s *Source) begin(ctx context.Context, q string, args []any) (*pgxpool.Conn, pgx.BatchResults, error) {
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("begin claim: %w", err)
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
	return conn, conn.SendBatch(ctx, b), nil
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
		unit           int
	)
	dest := []any{&r.Seq, &r.ID, &r.AggregateID, &r.Type, &r.Payload, &r.PayloadBytes, &r.ContentType, &r.Topic, &r.Headers,
		&r.CreatedAt, &r.Attempts, &r.Replays, &r.Size, &within, &unit, &passes}
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
		e.Unit = unit
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
