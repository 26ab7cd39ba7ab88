package console_test

import (
	"context"
	"log"
	"net/http"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/cmd/outbox/console"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/admin"
)

// Serve the console and its API from a program of one's own, next to its
// other handlers, with credentials from the environment.
func ExampleNew() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	ad, err := admin.New(pool, store.Config{}, nil)
	if err != nil {
		log.Fatal(err)
	}
	con, err := console.New(console.Options{
		Admin:    ad,
		Username: "ops",
		Password: os.Getenv("CONSOLE_PASSWORD"), // at least 16 bytes
		Token:    os.Getenv("CONSOLE_TOKEN"),    // for scripts; optional
	})
	if err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	for _, p := range console.Paths {
		mux.Handle(p, con)
	}
	log.Fatal(http.ListenAndServe("127.0.0.1:8080", mux))
}
