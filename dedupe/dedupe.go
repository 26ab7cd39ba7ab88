// Package dedupe turns the relay's at-least-once delivery into exactly-once
// effects on the consumer's PostgreSQL database.
//
// Each event is recorded in the processed_events table inside the same
// transaction as the handler's writes. The first delivery inserts the row,
// runs the handler and commits both together; any later delivery finds the
// row and is acknowledged without running the handler. A handler that fails
// or panics rolls the row back with its writes, so the redelivered event
// runs again.
//
// With Watermill, add the middleware to a router and reach the transaction
// with TxFromContext, or wrap handlers with Handler and NoPublishHandler to
// receive it as an argument:
//
//	d, err := dedupe.New(pool, dedupe.Options{Consumer: "loyalty"})
//	router.AddMiddleware(d.Middleware)
//
// Outside Watermill, Process gives the same guarantee for an event identity
// the caller supplies.
//
// Handlers on database/sql (pgx's stdlib driver, lib/pq, sqlx, GORM...)
// use NewSQL instead: the same Deduper over a *sql.DB, with *sql.Tx where
// this one has pgx.Tx.
package dedupe

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
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

// Deduper records processed events for one consumer, in pgx
// transactions. It is safe for concurrent use, also by many processes
// sharing the database. SQLDeduper is the same for database/sql.
type Deduper struct {
	pool *pgxpool.Pool
	eng  *engine[pgx.Tx]
}

// New returns a Deduper over pool. The schema must have been migrated
// (store.Migrate), which creates the processed table.
func New(pool *pgxpool.Pool, opts Options) (*Deduper, error) {
	if pool == nil {
		return nil, errors.New("new deduper: pool is nil")
	}
	d := &Deduper{pool: pool}
	eng, err := newEngine(opts, d, engineOps[pgx.Tx]{
		// Read committed, whatever the server's default: the insert must
		// wait for a concurrent duplicate and then see its outcome, where
		// stricter levels fail it with a serialization error instead.
		begin: func(ctx context.Context) (pgx.Tx, error) {
			return pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
		},
		record:   (*store.Processed).Record,
		commit:   func(ctx context.Context, tx pgx.Tx) error { return tx.Commit(ctx) },
		rollback: func(ctx context.Context, tx pgx.Tx) error { return tx.Rollback(ctx) },
	})
	if err != nil {
		return nil, fmt.Errorf("new deduper: %w", err)
	}
	d.eng = eng
	return d, nil
}

// TxFromContext returns the transaction the event is being processed in:
// the handler's writes on it commit together with the dedupe record. It is
// set in the message context by Middleware and in the context Process
// passes to its function.
func TxFromContext(ctx context.Context) (pgx.Tx, bool) {
	return txFrom[pgx.Tx](ctx)
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
func (d *Deduper) Process(ctx context.Context, eventID string, fn func(ctx context.Context, tx pgx.Tx) error) (applied bool, err error) {
	if err := checkEventID(eventID); err != nil {
		return false, fmt.Errorf("process event: %w", err)
	}
	return d.eng.run(ctx, eventID, true, fn)
}
