package migrate_test

import (
	"context"
	"log"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/migrate"
)

// Create or upgrade the outbox's tables in schema "app" before relays and
// producers start.
func ExampleMigrate() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	applied, err := migrate.Migrate(ctx, pool, store.Config{Schema: "app"})
	if err != nil {
		log.Fatal(err)
	}
	log.Printf("applied migrations %v", applied)
}
