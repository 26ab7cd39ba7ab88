package dedupe

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxhq/outbox/store"
)

// engine is what Deduper (pgx) and SQLDeduper (database/sql) share: one
// transaction per event with its dedupe record, T being the transaction.
type engine[T any] struct {
	opts      Options
	log       *slog.Logger
	processed *store.Processed
	owner     any // the Deduper or SQLDeduper, to recognise its own nested calls
	ops       engineOps[T]
}

type engineOps[T any] struct {
	begin    func(ctx context.Context) (T, error) // at read committed
	record   func(p *store.Processed, ctx context.Context, tx T, consumer, eventID string) (isNew bool, err error)
	commit   func(ctx context.Context, tx T) error
	rollback func(ctx context.Context, tx T) error
}

func newEngine[T any](opts Options, owner any, ops engineOps[T]) (*engine[T], error) {
	o, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	processed, err := store.NewProcessed(o.Store)
	if err != nil {
		return nil, err
	}
	return &engine[T]{opts: o, log: o.Logger.With("consumer", o.Consumer), processed: processed, owner: owner, ops: ops}, nil
}

type txKey struct{}

type txValue struct {
	tx      any
	owner   any
	eventID string
}

func txFrom[T any](ctx context.Context) (T, bool) {
	v, _ := ctx.Value(txKey{}).(txValue)
	tx, ok := v.tx.(T)
	return tx, ok
}

// active reports whether ctx is already inside this deduper's transaction
// for eventID, as when Middleware and Handler wrap one handler: the inner one
// must not start a second transaction, whose insert would wait forever on
// the first's uncommitted row.
func (e *engine[T]) active(ctx context.Context, eventID string) (T, bool) {
	v, _ := ctx.Value(txKey{}).(txValue)
	tx, ok := v.tx.(T)
	return tx, ok && v.owner == e.owner && v.eventID == eventID
}

// run processes in one transaction; record=false skips the dedupe row.
func (e *engine[T]) run(ctx context.Context, eventID string, record bool, fn func(ctx context.Context, tx T) error) (applied bool, err error) {
	if tx, ok := e.active(ctx, eventID); ok {
		// Nested inside this deduper's own transaction: already recorded,
		// and committed or rolled back by the outer call.
		err := fn(ctx, tx)
		return err == nil, err
	}
	tx, err := e.ops.begin(ctx)
	if err != nil {
		return false, fmt.Errorf("begin event %s: %w", eventID, err)
	}
	ended := false
	defer func() {
		// Also runs while a panic in fn unwinds.
		if !ended {
			_ = e.ops.rollback(context.WithoutCancel(ctx), tx)
		}
	}()
	if record {
		isNew, err := e.ops.record(e.processed, ctx, tx, e.opts.Consumer, eventID)
		if err != nil {
			return false, fmt.Errorf("event %s: %w", eventID, err)
		}
		if !isNew {
			return false, nil
		}
	}
	if err := fn(context.WithValue(ctx, txKey{}, txValue{tx: tx, owner: e.owner, eventID: eventID}), tx); err != nil {
		return false, err
	}
	// An error here leaves the outcome unknown when the connection broke
	// during the commit; the redelivery then finds the record or runs again.
	ended = true
	if err := e.ops.commit(ctx, tx); err != nil {
		return false, fmt.Errorf("commit event %s: %w", eventID, err)
	}
	return true, nil
}

// middleware is the Watermill middleware of Deduper.Middleware and
// SQLDeduper.Middleware.
func (e *engine[T]) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		id, idErr := EventID(msg)
		if _, ok := e.active(ctx, id); ok {
			return h(msg) // an inner wrapper of the same deduper
		}
		record := true
		if idErr != nil {
			e.log.ErrorContext(ctx, "message without event identity",
				"message_uuid", msg.UUID,
				"handler", message.HandlerNameFromCtx(ctx),
				"topic", message.SubscribeTopicFromCtx(ctx),
				"policy", e.opts.MissingID.String(),
				"error", idErr)
			if e.opts.MissingID == Reject {
				return nil, fmt.Errorf("dedupe message %s: %w", msg.UUID, idErr)
			}
			record = false
		}
		var out []*message.Message
		applied, err := e.run(ctx, id, record, func(txCtx context.Context, _ T) error {
			msg.SetContext(txCtx)
			defer msg.SetContext(ctx)
			var err error
			out, err = h(msg)
			return err
		})
		if err != nil {
			return nil, err
		}
		if !applied {
			e.log.DebugContext(ctx, "skipped duplicate event", "event_id", id, "message_uuid", msg.UUID)
			return nil, nil
		}
		return out, nil
	}
}
