package store

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Processed is the consumer dedupe table (processed_events): one row per
// consumer and event identity. The dedupe package records and cleans up
// through it, so the table's SQL lives here with its migration.
type Processed struct {
	record, cleanup string
}

// DBTX runs a statement: a pgx.Tx, a *pgxpool.Pool or a *pgx.Conn.
type DBTX interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// NewProcessed returns the processed table that cfg names.
func NewProcessed(cfg Config) (*Processed, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return nil, err
	}
	t := cfg.Names().Processed
	return &Processed{
		// Reports a new event as one affected row and a known one as none.
		// A concurrent transaction holding the same uncommitted row makes
		// this wait for its outcome: conflict if it commits, insert if not.
		record: `INSERT INTO ` + t + ` (consumer, event_id) VALUES ($1, $2) ON CONFLICT DO NOTHING`,
		// SKIP LOCKED: a record being written or deleted elsewhere is left
		// for the next batch rather than waited for.
		cleanup: `DELETE FROM ` + t + ` WHERE consumer = $1 AND event_id IN (
    SELECT event_id FROM ` + t + `
    WHERE consumer = $1 AND processed_at < now() - $2::bigint * interval '1 microsecond'
    LIMIT $3
    FOR UPDATE SKIP LOCKED
)`,
	}, nil
}

// Record inserts the record of consumer having processed eventID, in the
// caller's transaction. It reports false when the record already exists.
func (p *Processed) Record(ctx context.Context, tx pgx.Tx, consumer, eventID string) (bool, error) {
	tag, err := tx.Exec(ctx, p.record, consumer, eventID)
	if err != nil {
		return false, fmt.Errorf("record processed event: %w", err)
	}
	return tag.RowsAffected() == 1, nil
}

// CleanupBatch deletes up to limit of consumer's records older than
// olderThan and returns how many it deleted.
func (p *Processed) CleanupBatch(ctx context.Context, db DBTX, consumer string, olderThan time.Duration, limit int) (int64, error) {
	tag, err := db.Exec(ctx, p.cleanup, consumer, olderThan.Microseconds(), limit)
	if err != nil {
		return 0, fmt.Errorf("delete processed events: %w", err)
	}
	return tag.RowsAffected(), nil
}

// RecordSQL is Record for a database/sql transaction.
func (p *Processed) RecordSQL(ctx context.Context, tx SQLExecer, consumer, eventID string) (bool, error) {
	res, err := tx.ExecContext(ctx, p.record, consumer, eventID)
	if err != nil {
		return false, fmt.Errorf("record processed event: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, fmt.Errorf("record processed event: %w", err)
	}
	return n == 1, nil
}

// CleanupBatchSQL is CleanupBatch through database/sql.
func (p *Processed) CleanupBatchSQL(ctx context.Context, db SQLExecer, consumer string, olderThan time.Duration, limit int) (int64, error) {
	res, err := db.ExecContext(ctx, p.cleanup, consumer, olderThan.Microseconds(), limit)
	if err != nil {
		return 0, fmt.Errorf("delete processed events: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("delete processed events: %w", err)
	}
	return n, nil
}
