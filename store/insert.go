package store

import (
	"context"
	"fmt"
)

// Insert is the producer's statement: any number of rows in one statement
// and one round trip. The table's trigger (migration 4) sends the NOTIFY
// that wakes relays, so the statement does not.
type Insert struct{ sql string }

// InsertRows are the columns of the rows to insert, one entry per row.
// Payloads must be JSON and Headers JSON objects of strings (nil for none);
// the caller has checked them.
type InsertRows struct {
	IDs, AggregateIDs, Types, Payloads []string
	Headers                            []*string
}

// NewInsert prepares the insert into the outbox cfg names.
func NewInsert(cfg Config) (*Insert, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return nil, err
	}
	return &Insert{sql: `INSERT INTO ` + cfg.names().Outbox + ` (event_id, aggregate_id, type, payload, headers)
SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::text[]::json[], $5::text[]::jsonb[])`}, nil
}

// Exec inserts rows with tx, usually the caller's own transaction.
func (i *Insert) Exec(ctx context.Context, tx Execer, rows InsertRows) error {
	if _, err := tx.Exec(ctx, i.sql, rows.IDs, rows.AggregateIDs, rows.Types, rows.Payloads, rows.Headers); err != nil {
		return fmt.Errorf("insert %d events: %w", len(rows.IDs), err)
	}
	return nil
}
