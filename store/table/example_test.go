package table_test

import (
	"context"
	"log"
	"log/slog"
	"os"
	"os/signal"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/brokers/stdout"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/migrate"
	"github.com/outboxhq/outbox/store/table"
)

// Migrate the schema, open the table source and relay its events until
// interrupted.
func Example() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	logger := slog.New(slog.NewTextHandler(os.Stderr, nil))

	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	cfg := store.Config{Schema: "app"}
	if _, err := migrate.Migrate(ctx, pool, cfg); err != nil {
		log.Fatal(err)
	}
	s, err := table.New(pool, cfg, logger)
	if err != nil {
		log.Fatal(err)
	}

	var pub core.Publisher = stdout.New(os.Stdout, nil)
	relay, err := core.New(s, pub, core.Options{Logger: logger})
	if err != nil {
		log.Fatal(err)
	}
	if err := relay.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
