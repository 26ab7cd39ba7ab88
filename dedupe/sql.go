package dedupe

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxhq/outbox/store"
)

// SQLDeduper is Deduper for handlers on database/sql: the same records in
// the same table with the same guarantees, in a *sql.Tx. It works with any
// PostgreSQL driver (pgx's stdlib, lib/pq). It is safe for concurrent use.
type SQLDeduper struct {
	db  *sql.DB
	eng *engine[*sql.Tx]
}

// NewSQL returns an SQLDeduper over db. The schema must have been migrated
// (store.Migrate), which creates the processed table.
func NewSQL(db *sql.DB, opts Options) (*SQLDeduper, error) {
	if db == nil {
		return nil, errors.New("new deduper: db is nil")
	}
	d := &SQLDeduper{db: db}
	eng, err := newEngine(opts, d, engineOps[*sql.Tx]{
		// Read committed, as Deduper: see there.
		begin: func(ctx context.Context) (*sql.Tx, error) {
			return db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
		},
		record: func(p *store.Processed, ctx context.Context, tx *sql.Tx, consumer, eventID string) (bool, error) {
			return p.RecordSQL(ctx, tx, consumer, eventID)
		},
		commit:   func(_ context.Context, tx *sql.Tx) error { return tx.Commit() },
		rollback: func(_ context.Context, tx *sql.Tx) error { return tx.Rollback() },
	})
	if err != nil {
		return nil, fmt.Errorf("new deduper: %w", err)
	}
	d.eng = eng
	return d, nil
}

// SQLTxFromContext returns the *sql.Tx an SQLDeduper processes the event
// in, from the message context (Middleware) or the context Process passes
// to its function.
func SQLTxFromContext(ctx context.Context) (*sql.Tx, bool) {
	return txFrom[*sql.Tx](ctx)
}

// Process is Deduper.Process with a *sql.Tx.
func (d *SQLDeduper) Process(ctx context.Context, eventID string, fn func(ctx context.Context, tx *sql.Tx) error) (applied bool, err error) {
	if err := checkEventID(eventID); err != nil {
		return false, fmt.Errorf("process event: %w", err)
	}
	return d.eng.run(ctx, eventID, true, fn)
}

// Middleware is Deduper.Middleware; the handler finds its transaction with
// SQLTxFromContext.
func (d *SQLDeduper) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return d.eng.middleware(h)
}

// SQLTxHandlerFunc handles one message in the dedupe transaction.
type SQLTxHandlerFunc func(ctx context.Context, tx *sql.Tx, msg *message.Message) ([]*message.Message, error)

// Handler is Deduper.Handler with a *sql.Tx.
func (d *SQLDeduper) Handler(fn SQLTxHandlerFunc) message.HandlerFunc {
	return d.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := SQLTxFromContext(msg.Context())
		return fn(msg.Context(), tx, msg)
	})
}

// NoPublishHandler is Handler for router.AddConsumerHandler.
func (d *SQLDeduper) NoPublishHandler(fn func(ctx context.Context, tx *sql.Tx, msg *message.Message) error) message.NoPublishHandlerFunc {
	h := d.Handler(func(ctx context.Context, tx *sql.Tx, msg *message.Message) ([]*message.Message, error) {
		return nil, fn(ctx, tx, msg)
	})
	return func(msg *message.Message) error {
		_, err := h(msg)
		return err
	}
}

// Cleanup is Deduper.Cleanup.
func (d *SQLDeduper) Cleanup(ctx context.Context, olderThan time.Duration, batchSize int) (deleted int64, err error) {
	return cleanup(ctx, olderThan, batchSize, func(ctx context.Context) (int64, error) {
		return d.eng.processed.CleanupBatchSQL(ctx, d.db, d.eng.opts.Consumer, olderThan, batchSize)
	})
}
