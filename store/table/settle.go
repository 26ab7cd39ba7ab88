package table

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store"
)

var _ core.Settler = (*Source)(nil)

// settler is what core.Settler needs of the outbox the source reads: the
// units' name and the statement that finds the sent events still pending.
// The hand-off source reads the outbox's handoff view, but its events are
// the outbox's rows and its units the outbox's partitions: it settles by
// the outbox table, under the table source's name, so that an event
// published by a table-mode relay is known as such after a switch to log
// mode and back.
type settler struct {
	name      string
	unsettled string
}

func newSettler(cfg store.Config) settler {
	// By primary key alone, and the rest compared here: a condition on
	// dispatched_at could lead the planner to a partial index of pending
	// rows (see claimStillPending).
	return settler{
		name:      cfg.Schema + "." + cfg.Table,
		unsettled: `SELECT seq, event_id::text, replays, dispatched_at IS NULL FROM ` + cfg.Names().Outbox + ` WHERE seq = ANY($1::bigint[])`,
	}
}

// Units implements core.Settler: the outbox's partitions (Partitions),
// under its qualified name, schema.table, unquoted.
func (s *Source) Units() (name string, n int) { return s.settle.name, Partitions }

// Unsettled implements core.Settler: those of sent whose row is still
// pending, the same seq with the same event id and replays, and not
// dispatched, whatever else it is (parked, held, retrying: an operator
// can make it claimable again). A row gone, or a seq that holds another
// event, is settled: the source has nothing it could offer again under
// that event's seq. So is a row replayed since the send: what the
// source offers now is the replay, a new delivery. One statement by
// primary key.
func (s *Source) Unsettled(ctx context.Context, sent []core.Sent) ([]core.Sent, error) {
	if len(sent) == 0 {
		return nil, nil
	}
	seqs := make([]int64, len(sent))
	for i, e := range sent {
		seqs[i] = e.Seq
	}
	pending, err := lookUpPending(ctx, s.pool, s.settle.unsettled, seqs)
	if err != nil {
		return nil, fmt.Errorf("look up sent events: %w", err)
	}
	var out []core.Sent
	for _, e := range sent {
		if p, ok := pending[e.Seq]; ok && p.id == e.ID && p.replays == e.Replays {
			out = append(out, e)
		}
	}
	return out, nil
}

// pendingRow is a pending row's event id and replays.
type pendingRow struct {
	id      string
	replays int
}

// lookUpPending runs q, which selects seq, event_id::text, replays and
// whether the row is pending for the rows seqs, and returns the pending
// rows by seq.
func lookUpPending(ctx context.Context, pool *pgxpool.Pool, q string, seqs []int64) (map[int64]pendingRow, error) {
	rows, err := pool.Query(ctx, q, seqs)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[int64]pendingRow{}
	var (
		seq     int64
		r       pendingRow
		pending bool
	)
	for rows.Next() {
		if err := rows.Scan(&seq, &r.id, &r.replays, &pending); err != nil {
			return nil, err
		}
		if pending {
			out[seq] = r
		}
	}
	return out, rows.Err()
}
