// Command quickstart migrates the outbox, writes an event in the
// transaction that places an order, and relays committed events to Kafka
// until interrupted. Run it with DATABASE_URL set and a broker on
// localhost:9092.
package main

import (
	"context"
	"log"
	"os"
	"os/signal"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/kafka"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/migrate"
	"github.com/outboxhq/outbox/store/table"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	// Create or upgrade the outbox tables (public.events_outbox).
	if _, err := migrate.Migrate(ctx, pool, store.Config{}); err != nil {
		log.Fatal(err)
	}

	// Write the event in the same transaction as the change it announces:
	// both commit, or neither does.
	w, err := outbox.NewWriter(outbox.WriterOptions{})
	if err != nil {
		log.Fatal(err)
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		// Your business writes go here, on tx.
		return w.Write(ctx, tx, outbox.Message{
			AggregateID: "order-42", // the ordering key
			Type:        "order.placed",
			Payload:     map[string]int{"total_cents": 4200},
		})
	})
	if err != nil {
		log.Fatal(err)
	}

	// Relay committed events to Kafka (topic "order", from the type) until
	// interrupted. Any number of relays may run: each aggregate stays in order.
	pub, err := kafka.New(ctx, kafka.Config{Brokers: []string{"localhost:9092"}}, &brokers.Routing{}, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()
	st, err := table.New(pool, store.Config{}, nil)
	if err != nil {
		log.Fatal(err)
	}
	relay, err := core.New(st, pub, core.Options{})
	if err != nil {
		log.Fatal(err)
	}
	if err := relay.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
