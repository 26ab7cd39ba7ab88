package dedupe

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/store"
)

// Policy says what the middleware does with a message that carries no
// usable event identity.
type Policy int

const (
	// Reject returns an error wrapping ErrNoEventID without running the
	// handler, so the router's poison handling takes the message (see
	// Watermill's middleware.PoisonQueue). It is the default.
	Reject Policy = iota
	// ProcessWithoutDedupe runs the handler in a transaction as usual but
	// records nothing, so a redelivery runs it again.
	ProcessWithoutDedupe
)

func (p Policy) String() string {
	switch p {
	case Reject:
		return "reject"
	case ProcessWithoutDedupe:
		return "process-without-dedupe"
	}
	return fmt.Sprintf("Policy(%d)", int(p))
}

// maxConsumer bounds the consumer name; it is part of every row's key.
const maxConsumer = 200

// Options configure a Deduper.
type Options struct {
	// Consumer names the consuming service or handler; required. Events are
	// deduplicated per consumer, so two consumers of one event each run it
	// once. Changing it makes every retained event new again.
	Consumer string
	Store    store.Config // names the processed table; defaults as in store.Config
	// MissingID is what to do with a message without a usable event
	// identity; default Reject.
	MissingID Policy
	Logger    *slog.Logger // default: discard
}

func (o Options) withDefaults() (Options, error) {
	switch {
	case strings.TrimSpace(o.Consumer) == "":
		return o, errors.New("dedupe options: Consumer is required")
	case len(o.Consumer) > maxConsumer:
		return o, fmt.Errorf("dedupe options: Consumer is longer than %d bytes", maxConsumer)
	case !utf8.ValidString(o.Consumer) || strings.ContainsFunc(o.Consumer, unicode.IsControl):
		return o, fmt.Errorf("dedupe options: Consumer %q has invalid or control characters", o.Consumer)
	case o.MissingID != Reject && o.MissingID != ProcessWithoutDedupe:
		return o, fmt.Errorf("dedupe options: MissingID %d is not a known policy", int(o.MissingID))
	}
	cfg, err := o.Store.WithDefaults()
	if err != nil {
		return o, fmt.Errorf("dedupe options: %w", err)
	}
	o.Store = cfg
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return o, nil
}

// Deduper records processed events for one consumer, in transactions of
// type T: pgx.Tx for a Deduper from New, *sql.Tx for one from NewSQL. It is
// safe for concurrent use, also by many processes sharing the database.
type Deduper[T any] struct {
	opts      Options
	log       *slog.Logger
	processed *store.Processed
	tx        txOps[T]
}

// txOps is what differs between the database APIs: how to begin, end and
// clean up, and which statement records in a T.
type txOps[T any] struct {
	begin    func(ctx context.Context) (T, error) // at read committed
	record   func(ctx context.Context, p *store.Processed, tx T, consumer, eventID string) (isNew bool, err error)
	commit   func(ctx context.Context, tx T) error
	rollback func(ctx context.Context, tx T) error
	cleanup  func(ctx context.Context, p *store.Processed, consumer string, olderThan time.Duration, limit int) (int64, error)
}

// New returns a Deduper over pool, processing events in pgx transactions.
// The schema must have been migrated, which creates the processed table.
func New(pool *pgxpool.Pool, opts Options) (*Deduper[pgx.Tx], error) {
	if pool == nil {
		return nil, errors.New("new deduper: pool is nil")
	}
	return newDeduper(opts, txOps[pgx.Tx]{
		// Read committed, whatever the server's default: the insert must
		// wait for a concurrent duplicate and then see its outcome, where
		// stricter levels fail it with a serialization error instead.
		begin: func(ctx context.Context) (pgx.Tx, error) {
			return pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
		},
		record: func(ctx context.Context, p *store.Processed, tx pgx.Tx, consumer, eventID string) (bool, error) {
			return p.Record(ctx, tx, consumer, eventID)
		},
		commit:   func(ctx context.Context, tx pgx.Tx) error { return tx.Commit(ctx) },
		rollback: func(ctx context.Context, tx pgx.Tx) error { return tx.Rollback(ctx) },
		cleanup: func(ctx context.Context, p *store.Processed, consumer string, olderThan time.Duration, limit int) (int64, error) {
			return p.CleanupBatch(ctx, pool, consumer, olderThan, limit)
		},
	})
}

// NewSQL returns a Deduper over db, processing events in database/sql
// transactions: the same records in the same table with the same
// guarantees as New's. It works with any PostgreSQL driver (pgx's stdlib,
// lib/pq). The schema must have been migrated.
func NewSQL(db *sql.DB, opts Options) (*Deduper[*sql.Tx], error) {
	if db == nil {
		return nil, errors.New("new deduper: db is nil")
	}
	return newDeduper(opts, txOps[*sql.Tx]{
		// Read committed, as in New: see there.
		begin: func(ctx context.Context) (*sql.Tx, error) {
			return db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
		},
		record: func(ctx context.Context, p *store.Processed, tx *sql.Tx, consumer, eventID string) (bool, error) {
			return p.RecordSQL(ctx, tx, consumer, eventID)
		},
		commit:   func(_ context.Context, tx *sql.Tx) error { return tx.Commit() },
		rollback: func(_ context.Context, tx *sql.Tx) error { return tx.Rollback() },
		cleanup: func(ctx context.Context, p *store.Processed, consumer string, olderThan time.Duration, limit int) (int64, error) {
			return p.CleanupBatchSQL(ctx, db, consumer, olderThan, limit)
		},
	})
}

func newDeduper[T any](opts Options, tx txOps[T]) (*Deduper[T], error) {
	o, err := opts.withDefaults()
	if err != nil {
		return nil, fmt.Errorf("new deduper: %w", err)
	}
	processed, err := store.NewProcessed(o.Store)
	if err != nil {
		return nil, fmt.Errorf("new deduper: %w", err)
	}
	return &Deduper[T]{opts: o, log: o.Logger.With("consumer", o.Consumer), processed: processed, tx: tx}, nil
}
