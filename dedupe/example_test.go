package dedupe_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/core/event"
	"github.com/outboxhq/outbox/dedupe"
)

// A loyalty service adds each order's points to the customer's balance,
// once per order.placed event however often it is delivered.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://localhost/shop")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	d, err := dedupe.New(pool, dedupe.Options{Consumer: "loyalty", Logger: slog.Default()})
	if err != nil {
		log.Fatal(err)
	}

	var sub message.Subscriber // the broker's subscriber: AMQP, Kafka, ...
	var pub message.Publisher  // for the poison queue
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NewSlogLogger(slog.Default()))
	if err != nil {
		log.Fatal(err)
	}
	// Messages without an event identity go to a poison topic instead of
	// being redelivered forever.
	poison, err := middleware.PoisonQueueWithFilter(pub, "orders.poison", func(err error) bool {
		return errors.Is(err, dedupe.ErrNoEventID)
	})
	if err != nil {
		log.Fatal(err)
	}
	router.AddMiddleware(poison, d.Middleware)

	router.AddConsumerHandler("award-points", "order", sub, func(msg *message.Message) error {
		var order struct {
			CustomerID string `json:"customer_id"`
			Points     int64  `json:"points"`
		}
		if err := json.Unmarshal(msg.Payload, &order); err != nil {
			return fmt.Errorf("decode order: %w", err)
		}
		tx, _ := dedupe.TxFromContext[pgx.Tx](msg.Context())
		_, err := tx.Exec(msg.Context(), `INSERT INTO loyalty_points (customer_id, balance) VALUES ($1, $2)
ON CONFLICT (customer_id) DO UPDATE SET balance = loyalty_points.balance + EXCLUDED.balance`,
			order.CustomerID, order.Points)
		return err // an error rolls back the balance and the dedupe record together
	})

	if err := router.Run(ctx); err != nil {
		log.Fatal(err)
	}
}

// Consume an event and emit the next one through the outbox in the same
// transaction: the dedupe record, the balance and the new event commit
// together, and the relay publishes points.awarded after the commit.
func ExampleDeduper_Handler() {
	var pool *pgxpool.Pool // connected to the service's database
	d, err := dedupe.New(pool, dedupe.Options{Consumer: "loyalty"})
	if err != nil {
		log.Fatal(err)
	}
	w, err := outbox.NewWriter(outbox.WriterOptions{})
	if err != nil {
		log.Fatal(err)
	}

	handler := d.NoPublishHandler(func(ctx context.Context, tx pgx.Tx, msg *message.Message) error {
		var order struct {
			CustomerID string `json:"customer_id"`
			Points     int64  `json:"points"`
		}
		if err := json.Unmarshal(msg.Payload, &order); err != nil {
			return fmt.Errorf("decode order: %w", err)
		}
		if _, err := tx.Exec(ctx, `UPDATE loyalty_points SET balance = balance + $2 WHERE customer_id = $1`,
			order.CustomerID, order.Points); err != nil {
			return fmt.Errorf("award points: %w", err)
		}
		return w.Write(ctx, tx, outbox.Message{
			AggregateID: order.CustomerID,
			Type:        "points.awarded",
			Payload:     map[string]any{"customer_id": order.CustomerID, "points": order.Points},
		})
	})

	var router *message.Router
	var sub message.Subscriber
	router.AddConsumerHandler("award-points", "order", sub, handler)
}

// Outside Watermill the caller supplies the event identity, here from a
// queue library's message header.
func ExampleDeduper_Process() {
	var pool *pgxpool.Pool
	d, err := dedupe.New(pool, dedupe.Options{Consumer: "invoicing"})
	if err != nil {
		log.Fatal(err)
	}
	headers := map[string]string{event.HeaderEventID: "0199a1b2-3c4d-7e5f-8a9b-0c1d2e3f4a5b"}

	applied, err := d.Process(context.Background(), headers[event.HeaderEventID], func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO invoices (order_id) VALUES ($1)`, "order-42")
		return err
	})
	if err != nil {
		log.Fatal(err) // not recorded: acknowledge nothing, let it be redelivered
	}
	if !applied {
		log.Print("duplicate delivery, already invoiced")
	}
}

// Delete records past the retention window nightly, in batches of 10,000.
// The window must exceed the longest time an event can be redelivered.
func ExampleDeduper_Cleanup() {
	var d *dedupe.Deduper[pgx.Tx]
	ctx := context.Background()
	for {
		deleted, err := d.Cleanup(ctx, 30*24*time.Hour, 10_000)
		if err != nil {
			log.Print(err)
		} else {
			log.Printf("deleted %d processed-event records", deleted)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(24 * time.Hour):
		}
	}
}

func ExampleEventID() {
	msg := message.NewMessage(watermill.NewUUID(), nil)
	msg.Metadata.Set(event.HeaderEventID, "0199a1b2-3c4d-7e5f-8a9b-0c1d2e3f4a5b")
	id, err := dedupe.EventID(msg)
	fmt.Println(id, err)

	_, err = dedupe.EventID(message.NewMessage(watermill.NewUUID(), nil))
	fmt.Println(errors.Is(err, dedupe.ErrNoEventID))
	// Output:
	// 0199a1b2-3c4d-7e5f-8a9b-0c1d2e3f4a5b <nil>
	// true
}

// A handler on database/sql gets the same once-per-event guarantee with a
// *sql.Tx: its writes and the dedupe record commit together.
func ExampleNewSQL() {
	db, err := sql.Open("pgx", "postgres://localhost/shop") // or lib/pq's "postgres"
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	d, err := dedupe.NewSQL(db, dedupe.Options{Consumer: "invoicing"})
	if err != nil {
		log.Fatal(err)
	}
	var router *message.Router
	var sub message.Subscriber
	router.AddConsumerHandler("invoice", "order", sub, d.NoPublishHandler(
		func(ctx context.Context, tx *sql.Tx, msg *message.Message) error {
			_, err := tx.ExecContext(ctx, `INSERT INTO invoices (order_id) VALUES ($1)`, msg.Metadata.Get(event.HeaderAggregateID))
			return err
		}))
}
