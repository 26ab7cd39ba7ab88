package logrelay

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/core"
)

// Pair is log mode whole, as `outbox relay --mode log` runs it: the log
// relay reading the slot and, beside it, a table relay over the handoff
// view (store.Config.HandOff) that publishes what the log relay hands to the
// table: a failing event and its aggregate's later ones, rows committed
// before the slot existed, an operator's replay, retry or unpark. A
// service that embeds log mode runs a Pair: a log relay alone leaves
// those events pending forever.
type Pair struct {
	Log   *Relay
	Table *core.Relay
	// staleAfter is the table relay's StaleAfter, which the log relay's
	// progress check uses too.
	staleAfter time.Duration
}

// NewPair returns the two relays over pool, publishing to pub. opts
// configure the log relay and name the outbox (opts.Store); handoff is
// the table source over the outbox's handoff view (table.NewHandOff
// builds it), and table configures the table
// relay over it. The table relay is woken by the log relay's hand-offs
// rather than by the table's NOTIFY, which fires for every insert the log
// relay publishes itself.
func NewPair(pool *pgxpool.Pool, pub core.Publisher, opts Options, handoff core.Source, table core.Options) (*Pair, error) {
	if pool == nil || pub == nil {
		return nil, errors.New("new log relay pair: pool and publisher are required")
	}
	if handoff == nil {
		return nil, errors.New("new log relay pair: the hand-off source is required")
	}
	table.DisableWakeups = true
	tableRelay, err := core.New(handoff, pub, table)
	if err != nil {
		return nil, fmt.Errorf("new log relay pair: table relay: %w", err)
	}
	if user := opts.HandedOff; user != nil {
		opts.HandedOff = func() { tableRelay.Wake(); user() }
	} else {
		opts.HandedOff = tableRelay.Wake
	}
	logRelay, err := New(pool, pub, opts)
	if err != nil {
		return nil, fmt.Errorf("new log relay pair: %w", err)
	}
	return &Pair{Log: logRelay, Table: tableRelay, staleAfter: tableRelay.Options().StaleAfter}, nil
}

// Run runs both relays until ctx ends, then stops both (each drains and
// confirms by its ShutdownTimeout). It returns the first error of
// either; the log relay's end stops the table relay too.
func (p *Pair) Run(ctx context.Context) error {
	tctx, stopTable := context.WithCancel(ctx)
	tableDone := make(chan error, 1)
	go func() { tableDone <- p.Table.Run(tctx) }()
	err := p.Log.Run(ctx)
	stopTable()
	if terr := <-tableDone; terr != nil && err == nil {
		err = fmt.Errorf("relay table path: %w", terr)
	}
	return err
}

// Ready reports, for a readiness probe, the table relay's checks and then
// the log relay's (see Relay.Ready); the log relay counts as stalled
// after the table relay's StaleAfter.
func (p *Pair) Ready(ctx context.Context) []core.Check {
	return append(p.Table.Ready(ctx), p.LogReady()...)
}

// LogReady is the log relay's part of Ready.
func (p *Pair) LogReady() []core.Check { return p.Log.Ready(p.staleAfter) }
