package walrelay_test

import (
	"context"
	"log/slog"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/walrelay"
)

// The log relay and, beside it, the table path that publishes the events
// it hands to the table (poison events and those behind them).
func Example() {
	ctx := context.Background()
	var pool *pgxpool.Pool // pgxpool.New(ctx, url): a direct connection, not PgBouncer
	var pub core.Publisher // from brokers.Open
	if pool == nil || pub == nil {
		return
	}
	cfg := store.Config{Schema: "public", Table: "events_outbox"}
	hc, err := walrelay.HandoffConfig(cfg)
	if err != nil {
		panic(err)
	}
	hst, err := store.New(pool, hc, nil)
	if err != nil {
		panic(err)
	}
	tableRelay, err := core.New(hst, pub, core.Options{DisableWakeups: true})
	if err != nil {
		panic(err)
	}
	go func() { _ = tableRelay.Run(ctx) }()

	r, err := walrelay.New(pool, pub, walrelay.Options{
		Store: cfg, CreateSlot: true, HandedOff: tableRelay.Wake, Logger: slog.Default(),
	})
	if err != nil {
		panic(err)
	}
	// Returns on ctx's end, or at once for wal_level or REPLICATION errors.
	if err := r.Run(ctx); err != nil {
		panic(err)
	}
}
