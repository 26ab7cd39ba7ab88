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

// Deduper records processed events for one consumer. It is safe for
// concurrent use, also by many processes sharing the database.
type Deduper struct {
	pool *pgxpool.Pool
	opts Options
	log  *slog.Logger

	processed *store.Processed
}

// New returns a Deduper over pool. The schema must have been migrated
// (store.Migrate), which creates the processed table.
func New(pool *pgxpool.Pool, opts Options) (*Deduper, error) {
	if pool == nil {
		return nil, errors.New("new deduper: pool is nil")
	}
	o, err := opts.withDefaults()
	if err != nil {
		return nil, fmt.Errorf("new deduper: %w", err)
	}
	processed, err := store.NewProcessed(o.Store)
	if err != nil {
		return nil, fmt.Errorf("new deduper: %w", err)
	}
	return &Deduper{pool: pool, opts: o, log: o.Logger.With("consumer", o.Consumer), processed: processed}, nil
}

type txKey struct{}

type txValue struct {
	tx      pgx.Tx
	d       *Deduper
	eventID string
}

// TxFromContext returns the transaction the event is being processed in:
// the handler's writes on it commit together with the dedupe record. It is
// set in the message context by Middleware and in the context Process
// passes to its function.
func TxFromContext(ctx context.Context) (pgx.Tx, bool) {
	v, ok := ctx.Value(txKey{}).(txValue)
	return v.tx, ok
}

// active reports whether ctx is already inside this Deduper's transaction
// for eventID, as when Middleware and Handler wrap one handler: the inner one
// must not start a second transaction, whose insert would wait forever on
// the first's uncommitted row.
func (d *Deduper) active(ctx context.Context, eventID string) (pgx.Tx, bool) {
	v, ok := ctx.Value(txKey{}).(txValue)
	return v.tx, ok && v.d == d && v.eventID == eventID
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
	return d.run(ctx, eventID, true, fn)
}

// run processes in one transaction; record=false skips the dedupe row.
func (d *Deduper) run(ctx context.Context, eventID string, record bool, fn func(ctx context.Context, tx pgx.Tx) error) (applied bool, err error) {
	if tx, ok := d.active(ctx, eventID); ok {
		// Nested inside this Deduper's own transaction: already recorded,
		// and committed or rolled back by the outer call.
		err := fn(ctx, tx)
		return err == nil, err
	}
	// Read committed, whatever the server's default: the insert must wait
	// for a concurrent duplicate and then see its outcome, where stricter
	// levels fail it with a serialization error instead.
	tx, err := d.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	if err != nil {
		return false, fmt.Errorf("begin event %s: %w", eventID, err)
	}
	ended := false
	defer func() {
		// Also runs while a panic in fn unwinds.
		if !ended {
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
	}()
	if record {
		isNew, err := d.processed.Record(ctx, tx, d.opts.Consumer, eventID)
		if err != nil {
			return false, fmt.Errorf("event %s: %w", eventID, err)
		}
		if !isNew {
			return false, nil
		}
	}
	if err := fn(context.WithValue(ctx, txKey{}, txValue{tx: tx, d: d, eventID: eventID}), tx); err != nil {
		return false, err
	}
	// An error here leaves the outcome unknown when the connection broke
	// during the commit; the redelivery then finds the record or runs again.
	ended = true
	if err := tx.Commit(ctx); err != nil {
		return false, fmt.Errorf("commit event %s: %w", eventID, err)
	}
	return true, nil
}
