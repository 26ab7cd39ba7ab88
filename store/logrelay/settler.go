package logrelay

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/jackc/pglogrepl"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store"
)

// The stream as a core.Settler: which sent events a session could offer
// again.
//
// A row is offered again only by a session that reads its insert again
// and finds it not dispatched (dropSent): it is unsettled while it is not
// dispatched. A log-only event (and a row no longer at its seq: handed
// to the table, which renumbers it, or deleted) has no record but the
// slot's position: it is offered again while a new session would resume
// before the end of its transaction. A new session resumes from the later
// of the slot's confirmed position and the position the relay recorded
// (startPosition); the slot's can move back after a crash of the server,
// the recorded one never does, so the lower of the two as they are now
// is a position every later session resumes at or after. The stream
// decodes only committed transactions (no streaming of transactions in
// progress), and in commit order, so a transaction's end is known once
// its commit arrives, and every event ever sent to any session ends at
// or before the server's WAL position at any later time: that bounds an
// event this relay did not read itself, or no longer remembers.

var _ core.Settler = (*stream)(nil)

// maxLedger bounds the log-only events the ledger remembers; one it
// forgets is bounded by the WAL position when it is first asked about.
const maxLedger = 1 << 16

// ledger remembers, for the log-only events this relay's sessions read,
// where their transactions end, and for the events it was asked about
// without having read them, the server's WAL position when first asked.
// It records only once a publisher asked for it (Units or Unsettled), so
// a relay without one keeps nothing.
type ledger struct {
	on atomic.Bool

	mu sync.Mutex
	// ends maps a log-only event's seq (its message's position) to the
	// end of its transaction; 0 while the commit has not arrived.
	ends map[int64]pglogrepl.LSN
	// asked maps the seq of an event not in ends to the WAL position when
	// Unsettled was first asked about it.
	asked map[int64]pglogrepl.LSN
}

// read records a log-only event read in an open transaction.
func (l *ledger) read(seq int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.ends == nil {
		l.ends = map[int64]pglogrepl.LSN{}
	}
	l.ends[seq] = 0
	if len(l.ends) > maxLedger {
		// Any entry may go: see maxLedger.
		for s := range l.ends {
			delete(l.ends, s)
			if len(l.ends) <= maxLedger*3/4 {
				break
			}
		}
	}
}

// committed records where the transaction of the events seqs ends.
func (l *ledger) committed(seqs []int64, end pglogrepl.LSN) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, s := range seqs {
		if _, ok := l.ends[s]; ok {
			l.ends[s] = end
		}
	}
}

// newSession is a session's start, at WAL position horizon: an earlier
// session's transaction whose commit it did not read ended before it.
func (l *ledger) newSession(horizon pglogrepl.LSN) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for s, end := range l.ends {
		if end == 0 {
			l.ends[s] = horizon
		}
	}
}

// unsettled says, for log-only events (or rows not found at their seq),
// which a session could offer again: resume is the lowest position a new
// session resumes from (0: unknown), wal the server's WAL position now.
// Every entry settled at resume is forgotten.
func (l *ledger) unsettled(seqs []int64, resume, wal pglogrepl.LSN) map[int64]bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.asked == nil {
		l.asked = map[int64]pglogrepl.LSN{}
	}
	keep := make(map[int64]bool, len(seqs))
	for _, s := range seqs {
		end, ok := l.ends[s]
		if !ok {
			if end, ok = l.asked[s]; !ok {
				end = wal
				l.asked[s] = end
			}
		}
		keep[s] = end == 0 || resume < end
	}
	for s, end := range l.ends {
		if end != 0 && end <= resume {
			delete(l.ends, s)
		}
	}
	for s, end := range l.asked {
		if end <= resume {
			delete(l.asked, s)
		}
	}
	if len(l.asked) > maxLedger {
		// Asked about and never again: forgotten, an event is asked
		// about anew.
		clear(l.asked)
	}
	return keep
}

// Units implements core.Settler: one unit, the slot, named after the
// outbox's qualified name (schema.table, unquoted) and ".log", apart from
// the units of the table path's source. The relay remembers where the
// transactions of log-only events end from the first call on, so a
// publisher calls it when it binds, before the stream reads: an event
// read before is bounded instead by the WAL position when Unsettled is
// first asked about it, which a quiet outbox passes only with its next
// event.
func (s *stream) Units() (name string, n int) {
	s.r.ledger.on.Store(true)
	return s.r.unitsName, 1
}

// Unsettled implements core.Settler (see the top of this file): a row
// found at its seq with its id is unsettled while it is not dispatched
// and not replayed since (Sent.Replays); any other event while a new
// session would resume before the end of its transaction. One statement looks the rows up by primary key and
// reads both positions.
func (s *stream) Unsettled(ctx context.Context, sent []core.Sent) ([]core.Sent, error) {
	r := s.r
	r.ledger.on.Store(true)
	if len(sent) == 0 {
		return nil, nil
	}
	seqs := make([]int64, len(sent))
	for i, e := range sent {
		seqs[i] = e.Seq
	}
	st, err := r.sql.settled(ctx, r.pool, r.opts.Slot.Name, seqs)
	if err != nil {
		return nil, fmt.Errorf("look up sent events: %w", err)
	}
	var rest []int64
	for _, e := range sent {
		if _, ok := st.rows[rowKey{e.Seq, e.ID}]; !ok {
			rest = append(rest, e.Seq)
		}
	}
	var keep map[int64]bool
	if len(rest) > 0 {
		keep = r.ledger.unsettled(rest, st.resume, st.wal)
	}
	var out []core.Sent
	for _, e := range sent {
		r, row := st.rows[rowKey{e.Seq, e.ID}]
		if (row && r.pending && r.replays == e.Replays) || (!row && keep[e.Seq]) {
			out = append(out, e)
		}
	}
	return out, nil
}

// rowKey is a row by seq and event id.
type rowKey struct {
	seq int64
	id  string
}

// settledState is what Unsettled reads from the server.
type settledState struct {
	rows        map[rowKey]rowState // found by seq
	resume, wal pglogrepl.LSN
}

// rowState is a row's state for Unsettled.
type rowState struct {
	pending bool // not dispatched
	replays int
}

// settledSQL reads the rows seqs ($1), whether each is dispatched, the
// lower of the slot's ($2) confirmed position and the one the relay
// recorded (NULL when either is missing, or the recorded one is not this
// cluster's), and the WAL position.
func settledSQL(n store.Names) string {
	return `SELECT r.seqs, r.ids, r.pending, r.replays,
    (SELECT CASE WHEN s.confirmed_flush_lsn IS NOT NULL AND p.confirmed_lsn IS NOT NULL
            THEN least(s.confirmed_flush_lsn, p.confirmed_lsn)::text END
     FROM pg_replication_slots s, ` + n.LogSlot + ` p
     WHERE s.slot_name = $2 AND p.slot_name = $2 AND p.confirmed_lsn <= pg_current_wal_lsn()),
    pg_current_wal_lsn()::text
FROM (SELECT COALESCE(array_agg(seq), '{}') AS seqs, COALESCE(array_agg(event_id::text), '{}') AS ids,
        COALESCE(array_agg(dispatched_at IS NULL), '{}') AS pending, COALESCE(array_agg(replays), '{}') AS replays
      FROM ` + n.Outbox + ` WHERE seq = ANY($1::bigint[])) r`
}

// settled reads what Unsettled needs for the events seqs.
func (l *logTable) settled(ctx context.Context, db querier, slot string, seqs []int64) (settledState, error) {
	var (
		found   []int64
		ids     []string
		pending []bool
		replays []int
		resume  *string
		wal     string
		st      settledState
	)
	if err := db.QueryRow(ctx, l.settledSQL, seqs, slot).Scan(&found, &ids, &pending, &replays, &resume, &wal); err != nil {
		return st, err
	}
	st.rows = make(map[rowKey]rowState, len(found))
	for i, seq := range found {
		st.rows[rowKey{seq, ids[i]}] = rowState{pending: pending[i], replays: replays[i]}
	}
	var err error
	if st.wal, err = pglogrepl.ParseLSN(wal); err != nil {
		return st, err
	}
	if resume != nil {
		if st.resume, err = pglogrepl.ParseLSN(*resume); err != nil {
			return st, err
		}
	}
	return st, nil
}
