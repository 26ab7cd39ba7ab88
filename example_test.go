package outbox_test

import (
	"context"
	"database/sql"
	"log"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver

	"github.com/outboxhq/outbox"
)

// Write the event in the same transaction as the business change: both
// commit, or neither does.
func ExampleWriter_Write() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	w, err := outbox.NewWriter(outbox.WriterOptions{})
	if err != nil {
		log.Fatal(err)
	}

	type OrderPlaced struct {
		OrderID string `json:"order_id"`
		Total   int    `json:"total_cents"`
	}
	orderID := "0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0d"
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "INSERT INTO orders (id, total_cents) VALUES ($1, $2)", orderID, 4200); err != nil {
			return err
		}
		// An error here rolls back the order too.
		return w.Write(ctx, tx, outbox.Message{
			AggregateID: orderID,
			Type:        "order.placed",
			Payload:     OrderPlaced{OrderID: orderID, Total: 4200},
		})
	})
	if err != nil {
		log.Fatal(err)
	}
}

// Write the event into the WAL only (relay.mode log): no row, committed or
// rolled back with the transaction. The server needs wal_level=logical.
func ExampleLogWriter_Write() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	w, err := outbox.NewLogWriter(outbox.WriterOptions{})
	if err != nil {
		log.Fatal(err)
	}
	orderID := "0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0d"
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "INSERT INTO orders (id, total_cents) VALUES ($1, $2)", orderID, 4200); err != nil {
			return err
		}
		return w.Write(ctx, tx, outbox.Message{AggregateID: orderID, Type: "order.placed", Payload: []byte(`{"total_cents":4200}`)})
	})
	if err != nil {
		log.Fatal(err)
	}
}

// Code on database/sql (here through pgx's stdlib driver; lib/pq works
// too) writes events in its *sql.Tx the same way. This event carries a
// Protobuf payload, goes to a topic of its own and is published no
// earlier than a day from now.
func ExampleWriter_WriteSQL() {
	ctx := context.Background()
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	w, err := outbox.NewWriter(outbox.WriterOptions{})
	if err != nil {
		log.Fatal(err)
	}

	var reminder []byte // proto.Marshal(&pb.PaymentReminder{...})
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer tx.Rollback() // after Commit, a no-op
	if _, err := tx.ExecContext(ctx, "UPDATE invoices SET reminded = true WHERE id = $1", "inv_8Hq2"); err != nil {
		log.Fatal(err)
	}
	err = w.WriteSQL(ctx, tx, outbox.Message{
		AggregateID: "inv_8Hq2", // any string key
		Type:        "invoice.reminder_due",
		ContentType: "application/x-protobuf",
		Payload:     reminder,
		Topic:       "billing.reminders",
		DeliverAt:   time.Now().Add(24 * time.Hour),
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		log.Fatal(err)
	}
}
