package logrelay

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
)

// The stream is the engine's source (core.Source): a claim takes the
// events read so far, in stream order. The engine publishes them; a claim
// cannot offer an event again (the slot gives each once per session), so
// it is a core.HandOffer: what is not published goes to the table, in its
// aggregate's order. An event is done, and its transaction may be
// confirmed, once it is handed off, or published and, for a row, marked
// dispatched.

var (
	_ core.Source    = (*stream)(nil)
	_ core.HandOffer = (*claim)(nil)
)

// Claim takes up to req.Limit buffered events, less the rows published
// already (dropSent). The stream keeps each aggregate's order whatever
// req says. When the rows cannot be looked up the claim fails, its
// events back at the front of the buffer, in order: the engine claims
// again after its error backoff.
func (s *stream) Claim(ctx context.Context, req core.ClaimOptions) (core.Claim, error) {
	for {
		c := s.take(req.Limit)
		dropped, err := c.dropSent(ctx)
		if err != nil {
			s.giveBack(c.items)
			return nil, err
		}
		if !dropped || len(c.items) > 0 {
			return c, nil
		}
	}
}

// take takes up to limit buffered events.
func (s *stream) take(limit int) *claim {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := &claim{s: s, bySeq: map[int64]*item{}}
	n := 0
	for n < len(s.buffered) && n < limit {
		it := s.buffered[n]
		if c.bySeq[it.ev.Seq] != nil {
			// A row's seq equal to a message's position: the claim knows
			// its events by seq, so the second goes in the next claim.
			break
		}
		c.bySeq[it.ev.Seq] = it
		c.items = append(c.items, it)
		n++
	}
	clear(s.buffered[:n])
	s.buffered = s.buffered[n:]
	return c
}

// giveBack puts the events of a claim that failed back at the front of
// the buffer, in their order. The engine makes one claim at a time, so
// no later claim took events behind them meanwhile.
func (s *stream) giveBack(items []*item) {
	if len(items) == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.buffered = append(append(make([]*item, 0, len(items)+len(s.buffered)), items...), s.buffered...)
}

// dropSent leaves out, as done, the events that a relay reading the slot
// before this session dealt with but had not confirmed when it stopped
// (killed, frozen past wal_sender_timeout, its session failed): the slot
// gives them again, and the table says they went out or are its own. A
// row published and marked dispatched, or replayed since; a row or a
// log-only event handed to the table, which the table path publishes.
// Only events read from before the session's horizon are looked up, by
// event id. A lookup that fails fails the claim: publishing such an event
// again would send a duplicate, which a publisher that sends each event
// once (core.Settler) must never do. It says whether it left any out.
func (c *claim) dropSent(ctx context.Context) (bool, error) {
	var ids []string
	for _, it := range c.items {
		if !it.maybeSent {
			continue
		}
		if id, err := event.ParseID(it.ev.ID); err == nil {
			ids = append(ids, id)
		}
	}
	if len(ids) == 0 {
		return false, nil
	}
	s := c.s
	// Bounded: a server cut off would hold the claim, so the engine.
	lctx, cancel := context.WithTimeout(ctx, s.r.opts.ReceiveTimeout)
	done, err := s.r.sql.dealtWith(lctx, s.r.pool, ids)
	cancel()
	if err != nil {
		return false, fmt.Errorf("look up %d events read again after a takeover: %w", len(ids), err)
	}
	if len(done) == 0 {
		return false, nil
	}
	sent := make(map[string]bool, len(done))
	for _, id := range done {
		sent[id] = true
	}
	kept := c.items[:0]
	for _, it := range c.items {
		if id, err := event.ParseID(it.ev.ID); err == nil && it.maybeSent && sent[id] {
			delete(c.bySeq, it.ev.Seq)
			s.finish(it)
			continue
		}
		kept = append(kept, it)
	}
	clear(c.items[len(kept):])
	c.items = kept
	s.r.log.Debug("log relay: events read again, published or handed off already, left out", "events", len(done))
	return true, nil
}

// claim is a run of events read from the stream.
type claim struct {
	s     *stream
	items []*item
	bySeq map[int64]*item
}

func (c *claim) Events() []core.Event {
	out := make([]core.Event, len(c.items))
	for i, it := range c.items {
		out[i] = it.ev
	}
	return out
}

// Release is the end of an empty claim: nothing to record.
func (c *claim) Release(context.Context) error { return nil }

// Complete marks the published rows dispatched, with those of the claims
// that finish meanwhile (marker), retrying until it succeeds (an event
// nobody recorded must not be confirmed), and counts the published events
// done. The engine records no failures here, having handed them off; any
// that come are handed off too.
func (c *claim) Complete(ctx context.Context, done []int64, failed []core.Failure) error {
	s := c.s
	var rows []*item
	for _, seq := range done {
		if it := c.bySeq[seq]; it != nil && it.row {
			rows = append(rows, it)
		}
	}
	if err := s.marks.mark(ctx, rows); err != nil {
		return fmt.Errorf("mark %d events dispatched: %w", len(rows), err)
	}
	for _, seq := range done {
		if it := c.bySeq[seq]; it != nil {
			s.finish(it)
		}
	}
	for _, f := range failed {
		if it := c.bySeq[f.Seq]; it != nil {
			if err := s.retry(ctx, "hand event to the table", func() error { return c.HandOff(ctx, &it.ev, &f) }); err != nil {
				return err
			}
		}
	}
	return nil
}

// writeMarks marks rows dispatched, a batch at a time, each retried until
// it succeeds or ctx ends: an event nobody recorded must not be confirmed.
func (s *stream) writeMarks(ctx context.Context, rows []*item) error {
	for i := 0; i < len(rows); i += s.r.opts.BatchSize {
		part := rows[i:min(i+s.r.opts.BatchSize, len(rows))]
		var missing int
		err := s.retry(ctx, "mark events dispatched", func() (err error) {
			missing, err = s.r.sql.mark(ctx, s.r.pool, s.r.log, part)
			return err
		})
		if err != nil {
			return err
		}
		if missing > 0 {
			s.r.log.Warn("published rows not found to mark; deleted since", "rows", missing)
		}
	}
	return nil
}

// MustHandOff says whether e goes to the table: an earlier event of its
// aggregate waits there, it was inserted to wait or is scheduled, or it
// cannot be relayed.
func (c *claim) MustHandOff(ctx context.Context, e *core.Event) (bool, error) {
	it := c.bySeq[e.Seq]
	if it == nil {
		return false, fmt.Errorf("event %d is not in this claim", e.Seq)
	}
	if it.bad != nil || it.wait || it.deliverAt.After(c.s.serverNow()) {
		return true, nil
	}
	return c.s.isHandedOff(ctx, e.AggregateID)
}

// HandOff records e in the table for the table path: held with f's
// reason, or, with f nil, held when it cannot be relayed and pending
// otherwise (behind its aggregate's handed-off event, or scheduled). The
// aggregate's later events follow it there.
func (c *claim) HandOff(ctx context.Context, e *core.Event, f *core.Failure) error {
	s := c.s
	it := c.bySeq[e.Seq]
	if it == nil {
		return fmt.Errorf("event %d is not in this claim", e.Seq)
	}
	it.ev.Attempts = e.Attempts
	var reason error
	switch {
	case f != nil && !f.RetryAt.IsZero():
		reason, it.retryAt = errors.New(f.Reason), f.RetryAt
		s.r.log.Warn("event handed to the table after failing while others were published; retried there",
			"event_seq", e.Seq, "event_id", e.ID, "aggregate_id", e.AggregateID, "type", e.Type,
			"attempts", e.Attempts, "retry_at", it.retryAt, "error", f.Reason)
	case f != nil:
		reason = errors.New(f.Reason)
	case it.bad != nil:
		reason = core.Permanent(fmt.Errorf("cannot relay event: %w", it.bad))
	}
	if err := s.r.sql.handoff(ctx, s.r.pool, s.r.log, s.conn.PID(), it, reason); err != nil {
		return err
	}
	if reason != nil && it.retryAt.IsZero() {
		s.r.log.Warn("event held in the table: it cannot be published", "event_seq", e.Seq, "event_id", e.ID,
			"aggregate_id", e.AggregateID, "type", e.Type, "error", reason)
	}
	if f == nil && it.bad != nil {
		s.r.obs.Rejected(&it.ev, reason)
		s.r.obs.Completed(0, 1, 0)
	}
	s.mu.Lock()
	s.noteLocked(e.AggregateID, s.handedOff[e.AggregateID].xid)
	s.mu.Unlock()
	if s.r.opts.HandedOff != nil {
		s.r.opts.HandedOff()
	}
	s.finish(it)
	return nil
}

// retry calls f until it succeeds, backing off with ErrorBackoff; the
// error is ctx's once it ends first. A server that is shutting down ends
// the stream meanwhile (serverStops).
func (s *stream) retry(ctx context.Context, what string, f func() error) error {
	return s.r.opts.ErrorBackoff.Retry(ctx, func(func()) error { return f() }, func(err error, wait time.Duration) {
		if serverStopping(err) {
			s.serverStops(err)
		}
		s.r.obs.Errored("record", err)
		s.r.log.Error("log relay: "+what+" failed", "error", err, "retry_in", wait)
	})
}

// serverStopping reports the error of a server that refuses connections
// because it is shutting down (a session it ended on the way says only
// that it was terminated, as pg_terminate_backend does).
func serverStopping(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "57P03" // cannot_connect_now
}

// serverStops ends the stream once the server is shutting down. A fast
// shutdown waits until every walsender's client has confirmed all it was
// sent, and the events in flight cannot be recorded, so not confirmed,
// until the server is back: kept open, the stream would hold the shutdown
// until it timed out. The next session reads them again.
func (s *stream) serverStops(err error) {
	s.stopOnce.Do(func() {
		s.stopCause = err
		close(s.stopping)
	})
}
