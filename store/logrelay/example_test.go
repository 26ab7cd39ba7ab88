package logrelay_test

import (
	"context"
	"log/slog"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/logrelay"
	"github.com/outboxhq/outbox/store/table"
)

// Log mode in a service: the log relay and, beside it, the table relay
// that publishes the events it hands to the table (poison events and
// those behind them), as `outbox relay --mode log` runs them.
func ExampleNewPair() {
	ctx := context.Background()
	var pool *pgxpool.Pool // pgxpool.New(ctx, url): a direct connection, not PgBouncer
	var pub core.Publisher // from brokers.Open
	if pool == nil || pub == nil {
		return
	}
	opts := logrelay.Options{Store: store.Config{Schema: "public", Table: "events_outbox"}, Options: core.Options{Logger: slog.Default()}}
	// The table relay's source: the table source over the handoff view.
	handoff, err := table.NewHandOff(pool, opts.Store, slog.Default())
	if err != nil {
		panic(err)
	}
	p, err := logrelay.NewPair(pool, pub, opts, handoff, core.Options{Logger: slog.Default()})
	if err != nil {
		panic(err)
	}
	// p.Ready(ctx) serves a readiness probe.
	// Returns on ctx's end, or at once for wal_level or REPLICATION errors.
	if err := p.Run(ctx); err != nil {
		panic(err)
	}
}
