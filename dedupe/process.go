package dedupe

import (
	"context"
	"fmt"
)

type txKey struct{}

type txValue struct {
	tx      any
	owner   any // the Deduper, to recognise its own nested calls
	eventID string
}

// TxFromContext returns the transaction the event is being processed in:
// the handler's writes on it commit together with the dedupe record. It is
// set in the message context by Middleware and in the context Process
// passes to its function. T is the Deduper's transaction type: pgx.Tx for
// New's, *sql.Tx for NewSQL's; another type finds none.
func TxFromContext[T any](ctx context.Context) (T, bool) {
	v, _ := ctx.Value(txKey{}).(txValue)
	tx, ok := v.tx.(T)
	return tx, ok
}

// Process runs fn once per event identity for this consumer. It begins a
// transaction, records eventID and, when the event is new, calls fn with the
// transaction (also reachable with TxFromContext) and commits. applied
// reports whether fn ran and committed. A known event returns false and a
// nil error without calling fn. When fn returns an error, Process rolls
// back, the record included, and returns that error as it is; a panic in fn
// rolls back too and goes on up.
//
// A delivery of an event that another transaction is processing waits for
// it: when that one commits, this one is skipped; when it rolls back, this
// one runs.
func (d *Deduper[T]) Process(ctx context.Context, eventID string, fn func(ctx context.Context, tx T) error) (applied bool, err error) {
	if err := checkEventID(eventID); err != nil {
		return false, fmt.Errorf("process event: %w", err)
	}
	return d.run(ctx, eventID, true, fn)
}

// active reports whether ctx is already inside this deduper's transaction
// for eventID, as when Middleware and Handler wrap one handler: the inner one
// must not start a second transaction, whose insert would wait forever on
// the first's uncommitted row.
func (d *Deduper[T]) active(ctx context.Context, eventID string) (T, bool) {
	v, _ := ctx.Value(txKey{}).(txValue)
	tx, ok := v.tx.(T)
	return tx, ok && v.owner == d && v.eventID == eventID
}

// run processes in one transaction; record=false skips the dedupe row.
func (d *Deduper[T]) run(ctx context.Context, eventID string, record bool, fn func(ctx context.Context, tx T) error) (applied bool, err error) {
	if tx, ok := d.active(ctx, eventID); ok {
		// Nested inside this deduper's own transaction: already recorded,
		// and committed or rolled back by the outer call.
		err := fn(ctx, tx)
		return err == nil, err
	}
	tx, err := d.tx.begin(ctx)
	if err != nil {
		return false, fmt.Errorf("begin event %s: %w", eventID, err)
	}
	ended := false
	defer func() {
		// Also runs while a panic in fn unwinds.
		if !ended {
			_ = d.tx.rollback(context.WithoutCancel(ctx), tx)
		}
	}()
	if record {
		isNew, err := d.tx.record(ctx, d.processed, tx, d.opts.Consumer, eventID)
		if err != nil {
			return false, fmt.Errorf("event %s: %w", eventID, err)
		}
		if !isNew {
			return false, nil
		}
	}
	if err := fn(context.WithValue(ctx, txKey{}, txValue{tx: tx, owner: d, eventID: eventID}), tx); err != nil {
		return false, err
	}
	// An error here leaves the outcome unknown when the connection broke
	// during the commit; the redelivery then finds the record or runs again.
	ended = true
	if err := d.tx.commit(ctx, tx); err != nil {
		return false, fmt.Errorf("commit event %s: %w", eventID, err)
	}
	return true, nil
}
