package logrelay

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
)

// handOffNote is an aggregate known to have been handed off.
type handOffNote struct {
	// xid is the transaction whose hand-off notice named it (0 when known
	// otherwise): the notice can arrive before that transaction is
	// visible, and its rows are looked up only once it is.
	xid uint32
	// stamp orders the notes: a sweep forgets only aggregates noted
	// before its lookup began.
	stamp uint64
}

// minSweep is the fewest handed-off aggregates a sweep is started for:
// at once when their number doubled since the last sweep, else every
// sweepEvery status intervals.
const (
	minSweep   = 1024
	sweepEvery = 10
)

// loadHandedOff lists the aggregates with pending handed-off rows, whose
// later events must follow them through the table. It waits for a
// CreateSlot that is still handing rows off, and for the hand-offs in
// progress of the relay that held the slot before (see asHolder).
func (r *Relay) loadHandedOff(ctx context.Context) (map[string]handOffNote, error) {
	out := map[string]handOffNote{}
	err := pgx.BeginFunc(ctx, r.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", lockKey(r.opts.Slot)); err != nil {
			return err
		}
		aggs, err := r.sql.handedOffAggregates(ctx, tx)
		for _, a := range aggs {
			out[a] = handOffNote{}
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("list aggregates handed to the table: %w", err)
	}
	return out, nil
}

// isHandedOff says whether agg's events go to the table: it has pending
// handed-off rows. Only aggregates known to have had some are looked up.
func (s *stream) isHandedOff(ctx context.Context, agg string) (bool, error) {
	s.mu.Lock()
	note, known := s.handedOff[agg]
	s.mu.Unlock()
	if !known {
		return false, nil
	}
	if note.xid != 0 {
		if err := s.r.sql.waitVisible(ctx, s.r.pool, s.r.log, note.xid); err != nil {
			return false, err
		}
	}
	pending, err := s.r.sql.aggregateHandedOff(ctx, s.r.pool, agg)
	if err != nil {
		return false, err
	}
	s.mu.Lock()
	switch {
	case s.handedOff[agg] != note:
		// Named by a newer notice meanwhile: looked up again next time.
	case pending:
		s.handedOff[agg] = handOffNote{stamp: note.stamp}
	default:
		delete(s.handedOff, agg)
	}
	s.mu.Unlock()
	return pending, nil
}

// noteHandOff records the aggregates a replay, retry or unpark handed off
// (store.LogTable.HandOffPrefix). Read in commit order, the notice comes
// before every event committed after the command, so none of them can go
// out ahead of the rows it handed off.
func (s *stream) noteHandOff(m *pglogrepl.LogicalDecodingMessage) {
	aggs, err := parseHandOff(m.Content)
	if err != nil {
		s.r.log.Error("log relay: unreadable hand-off notice ignored; the aggregates it names may see new events go out ahead of their handed-off rows",
			"lsn", m.LSN.String(), "error", err)
		return
	}
	var xid uint32
	if m.Transactional && s.txn != nil {
		xid = s.txn.xid
	}
	s.mu.Lock()
	for _, a := range aggs {
		s.noteLocked(a, xid)
	}
	s.mu.Unlock()
}

// noteLocked records agg as handed off, named by transaction xid (0:
// known otherwise); s.mu is held.
func (s *stream) noteLocked(agg string, xid uint32) {
	s.notes++
	s.handedOff[agg] = handOffNote{xid: xid, stamp: s.notes}
}

// sweepDue says whether a sweep of the handed-off aggregates is due and
// none runs; true claims the sweep.
func (s *stream) sweepDue() bool {
	s.mu.Lock()
	n, at := len(s.handedOff), s.sweepAt
	s.mu.Unlock()
	due := n >= at || (n >= minSweep && time.Since(s.sweptAt) >= sweepEvery*s.r.opts.StatusInterval)
	if !due || !s.sweeping.CompareAndSwap(false, true) {
		return false
	}
	s.sweptAt = time.Now()
	return true
}

// sweepHandedOff forgets the handed-off aggregates that have nothing
// pending handed off any more, which a lookup forgets only when a later
// event of the aggregate arrives: one-off keys would keep them for the
// whole session. Only notes made before the lookup began are forgotten:
// a hand-off records its note after its rows commit, so the lookup sees
// the rows of every note it may forget; a notice's transaction must be
// visible first. The next sweep starts at twice the size left.
func (s *stream) sweepHandedOff(ctx context.Context) {
	defer s.sweeping.Store(false)
	s.mu.Lock()
	before := s.notes
	var xids []int64
	for _, n := range s.handedOff {
		if n.xid != 0 {
			xids = append(xids, int64(n.xid))
		}
	}
	s.mu.Unlock()
	visible, err := s.r.sql.visible(ctx, s.r.pool, xids)
	var aggs []string
	if err == nil {
		aggs, err = s.r.sql.handedOffAggregates(ctx, s.r.pool)
	}
	if err != nil {
		if ctx.Err() == nil {
			s.r.log.Warn("log relay: sweep of handed-off aggregates failed; tried again at the next status", "error", err)
		}
		return
	}
	pending := make(map[string]bool, len(aggs))
	for _, a := range aggs {
		pending[a] = true
	}
	s.mu.Lock()
	for agg, n := range s.handedOff {
		if n.stamp <= before && !pending[agg] && (n.xid == 0 || visible[n.xid]) {
			delete(s.handedOff, agg)
		}
	}
	s.sweepAt = max(minSweep, 2*len(s.handedOff))
	s.mu.Unlock()
}
