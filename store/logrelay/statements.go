package logrelay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store"
)

// statements are the relay's writes to the outbox table (logTable) and
// the checks on the slot and on transactions that go with them.
type statements struct {
	*logTable
	slot, lockKey string // the slot's name and advisory lock (see asHolder)
}

func newStatements(cfg store.Config, slot Slot) (statements, error) {
	t, err := newLogTable(cfg)
	if err != nil {
		return statements{}, err
	}
	return statements{logTable: t, slot: slot.Name, lockKey: lockKey(slot)}, nil
}

// visibleXIDs selects which of some transactions (by the 32-bit xids the
// stream gives, widened to the xid8 nearest the snapshot's xmax) this
// session sees.
const visibleXIDs = `SELECT x FROM unnest($1::bigint[]) AS x, pg_current_snapshot() AS s,
    LATERAL (SELECT pg_snapshot_xmax(s)::text::bigint AS xmax) m
WHERE pg_visible_in_snapshot((m.xmax + (x - m.xmax % 4294967296 + 6442450944) % 4294967296 - 2147483648)::text::xid8, s)`

// mark marks the published rows items dispatched; gone counts those
// found neither pending nor dispatched: deleted since (see settle).
func (q statements) mark(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger, items []*item) (gone int, err error) {
	return q.settle(ctx, pool, log, "mark events dispatched", items, func(pending []*item) ([]*item, error) {
		seqs := make([]int64, len(pending))
		for i, it := range pending {
			seqs[i] = it.ev.Seq
		}
		left, err := q.markDispatched(ctx, pool, seqs)
		if err != nil || len(left) == 0 {
			return nil, err
		}
		missed := make(map[int64]bool, len(left))
		for _, s := range left {
			missed[s] = true
		}
		var out []*item
		for _, it := range pending {
			if missed[it.ev.Seq] {
				out = append(out, it)
			}
		}
		return out, nil
	})
}

// settle applies a write to rows read from the stream until each is
// applied or known gone; apply returns the rows it missed. The stream can
// deliver a commit before the transaction is visible to other sessions
// (its commit record is flushed before it leaves the proc array, and with
// synchronous replication it stays invisible until a standby confirms
// it), so a missed row is tried again, for as long as that takes. It is
// gone (deleted since, as retention deletes rows dispatched earlier) only
// when apply misses it after its transaction was seen visible. Never
// giving up keeps the slot's position from passing an event nobody
// recorded.
func (q statements) settle(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger, what string, items []*item,
	apply func(pending []*item) ([]*item, error)) (gone int, err error) {
	pending := items
	visible := map[uint32]bool{} // transactions seen visible before the last apply
	start, warned := time.Now(), false
	for attempt := 0; ; attempt++ {
		missed, err := apply(pending)
		if err != nil {
			return gone, err
		}
		pending = pending[:0:0]
		for _, it := range missed {
			if visible[it.txn.xid] {
				gone++
			} else {
				pending = append(pending, it)
			}
		}
		if len(pending) == 0 {
			return gone, nil
		}
		if !warned && time.Since(start) > 5*time.Second {
			warned = true
			log.Warn("log relay: "+what+": rows not visible yet; waiting for their transactions to become visible (a synchronous standby that does not confirm holds them)",
				"rows", len(pending), "first_seq", pending[0].ev.Seq, "xid", pending[0].txn.xid, "waited", time.Since(start).Round(time.Millisecond))
		}
		xids := make([]int64, len(pending))
		for i, it := range pending {
			xids[i] = int64(it.txn.xid)
		}
		if visible, err = q.visible(ctx, pool, xids); err != nil {
			return gone, err
		}
		if !sleep(ctx, min(time.Duration(1+attempt)*4*time.Millisecond, time.Second)) {
			return gone, ctx.Err()
		}
	}
}

// visible says which of the transactions xids this session sees.
func (q statements) visible(ctx context.Context, pool *pgxpool.Pool, xids []int64) (map[uint32]bool, error) {
	out := map[uint32]bool{}
	if len(xids) == 0 {
		return out, nil
	}
	rows, err := pool.Query(ctx, visibleXIDs, xids)
	if err != nil {
		return nil, fmt.Errorf("check transactions visible: %w", err)
	}
	seen, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("check transactions visible: %w", err)
	}
	for _, x := range seen {
		out[uint32(x)] = true
	}
	return out, nil
}

// waitVisible waits until transaction xid, read from the stream, is
// visible to this relay's other sessions (see settle for why it may not
// be yet).
func (q statements) waitVisible(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger, xid uint32) error {
	start, warned := time.Now(), false
	for attempt := 0; ; attempt++ {
		var visible bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (`+visibleXIDs+`)`, []int64{int64(xid)}).Scan(&visible); err != nil {
			return fmt.Errorf("check transaction %d visible: %w", xid, err)
		}
		if visible {
			return nil
		}
		if !warned && time.Since(start) > 5*time.Second {
			warned = true
			log.Warn("log relay: a hand-off notice's transaction is not visible yet; its aggregate's events wait (a synchronous standby that does not confirm holds it)",
				"xid", xid, "waited", time.Since(start).Round(time.Millisecond))
		}
		if !sleep(ctx, min(time.Duration(1+attempt)*4*time.Millisecond, time.Second)) {
			return ctx.Err()
		}
	}
}

// errNotHolder is a hand-off refused because this session's walsender no
// longer holds the slot.
var errNotHolder = errors.New("this relay no longer holds the slot (another relay took it over): it hands nothing to the table")

// asHolder runs f in a transaction that holds the slot's lock, shared,
// and only while the walsender pid holds the slot. A relay that took the
// slot over lists the handed-off aggregates under that lock held
// exclusively, after its START_REPLICATION: so every hand-off of the
// relay before it either committed before that list was read, or finds
// the slot held by another walsender and is refused. A relay cut off from
// the server, still running, cannot hand an event over behind the new
// holder's back, which would then publish its aggregate's later events
// from the log ahead of it.
func (q statements) asHolder(ctx context.Context, pool *pgxpool.Pool, pid uint32, f func(tx pgx.Tx) error) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock_shared(hashtextextended($1, 0))", q.lockKey); err != nil {
			return err
		}
		var holds bool
		if err := tx.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND active_pid = $2)", q.slot, int64(pid)).Scan(&holds); err != nil {
			return err
		}
		if !holds {
			return errNotHolder
		}
		return f(tx)
	})
}

// handoff records it in the table for the table path: held with reason,
// or pending when reason is nil; pid is this session's walsender (see
// asHolder).
func (q statements) handoff(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger, pid uint32, it *item, reason error) error {
	var failed *core.Failure
	if reason != nil {
		failed = &core.Failure{Seq: it.ev.Seq, Reason: reason.Error(), RetryAt: it.retryAt}
	}
	if it.row {
		// As in mark: the row may not be visible yet.
		_, err := q.settle(ctx, pool, log, "hand event to the table", []*item{it}, func([]*item) ([]*item, error) {
			var seq int64
			var found bool
			err := q.asHolder(ctx, pool, pid, func(tx pgx.Tx) (err error) {
				seq, found, err = q.handRow(ctx, tx, it.ev.Seq, it.ev.ID, failed, it.ev.Attempts)
				return err
			})
			switch {
			case err != nil:
				return nil, err
			case seq != 0:
				it.ev.Seq = seq // its seq in the table from now on
			case !found:
				return []*item{it}, nil
			}
			return nil, nil
		})
		return err
	}
	return q.asHolder(ctx, pool, pid, func(tx pgx.Tx) error {
		if it.bad == nil {
			err := q.insertEvent(ctx, tx, logEvent{ID: it.ev.ID, AggregateID: it.ev.AggregateID, Type: it.ev.Type,
				ContentType: it.ev.ContentType, Topic: it.ev.Topic, Payload: it.ev.Payload, Headers: it.ev.Headers,
				CreatedAt: it.ev.CreatedAt, DeliverAt: it.deliverAt}, failed, it.ev.Attempts)
			var refused *refusedError
			if !errors.As(err, &refused) {
				return err
			}
			// Data the table's columns or checks refuse, which
			// DecodeMessage let through: held as unreadable instead, so
			// the stream never stops on it.
			if reason != nil {
				reason = fmt.Errorf("%w; %w", reason, refused)
			} else {
				reason = refused
			}
		}
		return q.insertUnreadable(ctx, tx, unreadable{Raw: it.raw, ID: it.ev.ID, AggregateID: it.ev.AggregateID,
			CreatedAt: it.ev.CreatedAt, Reason: reason.Error()})
	})
}
