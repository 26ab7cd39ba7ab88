package outboxcli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmgo "github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/gochannel"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/dedupe"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/migrate"
	"github.com/outboxhq/outbox/store/table"
)

const demoSchema = "outbox_demo"

func demoCmd() *cobra.Command {
	var orders int
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Show the outbox end to end: orders, rollbacks, relay, deduplicating consumer",
		Long: "demo places orders in transactions that also write order.placed events, rolls some back,\n" +
			"relays the committed events through an in-process broker that delivers each one twice,\n" +
			"and credits loyalty points once per event. It uses the schema " + demoSchema + ", recreated each run.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			e, err := setup(cmd)
			if err != nil {
				return err
			}
			if orders < 1 || orders > 100000 {
				return usagef("--orders: %d is not between 1 and 100000", orders)
			}
			return e.runDemo(cmd.Context(), orders)
		},
	}
	cmd.Flags().IntVar(&orders, "orders", 12, "orders to place")
	return cmd
}

type demoOrder struct {
	OrderID    string `json:"order_id"`
	Number     string `json:"number"`
	CustomerID string `json:"customer_id"`
	Amount     int    `json:"amount_cents"`
}

func (e *app) runDemo(ctx context.Context, orders int) error {
	out := e.out
	say := func(format string, a ...any) { fmt.Fprintf(out, format+"\n", a...) }
	pool, err := e.openPool(ctx, "outbox-demo")
	if err != nil {
		return err
	}
	defer pool.Close()
	cfg := store.Config{Schema: demoSchema}

	say("outbox demo: an order service that must never announce an order that rolled back,")
	say("and never lose one that committed.\n")
	if err := demoSetup(ctx, pool, cfg); err != nil {
		return err
	}
	say("1. Schema %s: outbox tables migrated, orders and loyalty tables created.", demoSchema)

	// Consumer first: the in-process broker keeps nothing for late subscribers.
	ch := wmgo.NewGoChannel(wmgo.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	defer ch.Close()
	var deliveries atomic.Int64
	router, err := demoConsumer(pool, cfg, ch, &deliveries, e.log)
	if err != nil {
		return err
	}
	rctx, stopRouter := context.WithCancel(ctx)
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(rctx) }()
	defer func() { stopRouter(); <-routerDone }()
	select {
	case <-router.Running():
	case <-ctx.Done():
		return ctx.Err()
	}

	say("2. Placing %d orders. Each transaction inserts the order and writes its order.placed event.", orders)
	say("   Every fourth order reuses an order number, so its insert fails and the transaction,")
	say("   event included, rolls back.")
	w, err := outbox.NewWriter(outbox.WriterOptions{Store: cfg, MaxPayloadBytes: e.cfg.Producer.MaxPayloadBytes})
	if err != nil {
		return err
	}
	customers := []string{uuid.NewString(), uuid.NewString(), uuid.NewString()}
	committed, rolledBack, expectedPoints := 0, 0, map[string]int{}
	for i := 0; i < orders; i++ {
		o := demoOrder{OrderID: uuid.NewString(), Number: fmt.Sprintf("A-%04d", 1001+i),
			CustomerID: customers[i%len(customers)], Amount: 1000 + 250*i + 130*(i%3)}
		if i%4 == 3 {
			o.Number = fmt.Sprintf("A-%04d", 1001+i-1) // duplicate: unique violation
		}
		err := placeOrder(ctx, pool, w, o)
		var pgErr *pgconn.PgError
		switch {
		case err == nil:
			committed++
			expectedPoints[o.CustomerID] += o.Amount / 100
			if orders <= 20 {
				say("   order %s committed, %d points due", o.Number, o.Amount/100)
			}
		case errors.As(err, &pgErr) && pgErr.Code == "23505":
			rolledBack++
			if orders <= 20 {
				say("   order %s rolled back: number already taken; its event is gone with it", o.Number)
			}
		default:
			return fmt.Errorf("place order %s: %w", o.Number, err)
		}
	}
	var inOutbox int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{demoSchema, "events_outbox"}.Sanitize()).Scan(&inOutbox); err != nil {
		return fmt.Errorf("count events: %w", err)
	}
	say("   %d committed, %d rolled back; the outbox holds %d events.", committed, rolledBack, inOutbox)

	say("3. The relay claims committed events (FOR UPDATE SKIP LOCKED), publishes them with the")
	say("   aggregate id as key and marks them dispatched. The demo broker delivers each event twice,")
	say("   as a broker redelivery or a relay crash before its mark would.")
	st, err := table.New(pool, cfg, e.log)
	if err != nil {
		return err
	}
	pub := twice{gochannel.New(ch, &brokers.Routing{})}
	relay, err := core.New(st, pub, core.Options{Logger: e.log, PollInterval: 100 * time.Millisecond})
	if err != nil {
		return err
	}
	if err := relay.Start(ctx); err != nil {
		return err
	}
	defer relay.Stop(context.Background())

	say("4. The loyalty consumer credits points in the same transaction that records the event id")
	say("   in processed_events, so a second delivery changes nothing.")
	deadline := time.Now().Add(30 * time.Second)
	var processed, dispatched int
	for {
		q := `SELECT (SELECT count(*) FROM ` + pgx.Identifier{demoSchema, "processed_events"}.Sanitize() + `),
		             (SELECT count(*) FROM ` + pgx.Identifier{demoSchema, "events_outbox"}.Sanitize() + ` WHERE dispatched_at IS NOT NULL)`
		if err := pool.QueryRow(ctx, q).Scan(&processed, &dispatched); err != nil {
			return fmt.Errorf("read progress: %w", err)
		}
		if processed == committed && dispatched == committed && deliveries.Load() >= int64(2*committed) {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("demo: timed out: %d of %d events dispatched, %d processed", dispatched, committed, processed)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}

	points, err := demoPoints(ctx, pool)
	if err != nil {
		return err
	}
	ok := true
	say("\nSummary")
	say("   orders committed            %d", committed)
	say("   orders rolled back          %d  (events for them: 0)", rolledBack)
	say("   events dispatched           %d", dispatched)
	say("   deliveries to the consumer  %d  (each event twice)", deliveries.Load())
	say("   events processed            %d  (once each)", processed)
	for i, c := range customers {
		mark := "ok"
		if points[c] != expectedPoints[c] {
			mark, ok = "WRONG", false
		}
		say("   customer %d points          %d, expected %d  %s", i+1, points[c], expectedPoints[c], mark)
	}
	if !ok || inOutbox != committed || processed != committed {
		return errors.New("demo: the figures do not add up")
	}
	say("\nEvery committed order was announced, no rolled-back order was, and redelivery did not")
	say("credit anyone twice.")
	return nil
}

func demoSetup(ctx context.Context, pool *pgxpool.Pool, cfg store.Config) error {
	if _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{demoSchema}.Sanitize()+" CASCADE"); err != nil {
		return fmt.Errorf("reset demo schema: %w", err)
	}
	if _, err := migrate.Migrate(ctx, pool, cfg); err != nil {
		return err
	}
	s := pgx.Identifier{demoSchema}.Sanitize()
	ddl := `CREATE TABLE ` + s + `.orders (id UUID PRIMARY KEY, number TEXT NOT NULL UNIQUE, customer_id UUID NOT NULL, amount_cents INT NOT NULL);
CREATE TABLE ` + s + `.loyalty (customer_id UUID PRIMARY KEY, points INT NOT NULL)`
	if _, err := pool.Exec(ctx, ddl); err != nil {
		return fmt.Errorf("create demo tables: %w", err)
	}
	return nil
}

// placeOrder writes the event first, then the order, to show that the
// event goes when the business write fails.
func placeOrder(ctx context.Context, pool *pgxpool.Pool, w *outbox.Writer, o demoOrder) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := w.Write(ctx, tx, outbox.Message{AggregateID: o.OrderID, Type: "order.placed", Payload: o}); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `INSERT INTO `+pgx.Identifier{demoSchema, "orders"}.Sanitize()+
			` (id, number, customer_id, amount_cents) VALUES ($1, $2, $3, $4)`, o.OrderID, o.Number, o.CustomerID, o.Amount)
		return err
	})
}

func demoConsumer(pool *pgxpool.Pool, cfg store.Config, ch *wmgo.GoChannel, deliveries *atomic.Int64, log *slog.Logger) (*message.Router, error) {
	d, err := dedupe.New(pool, dedupe.Options{Consumer: "loyalty", Store: cfg, Logger: log})
	if err != nil {
		return nil, err
	}
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		return nil, fmt.Errorf("new router: %w", err)
	}
	credit := d.NoPublishHandler(
		func(ctx context.Context, tx pgx.Tx, msg *message.Message) error {
			var o demoOrder
			if err := json.Unmarshal(msg.Payload, &o); err != nil {
				return fmt.Errorf("decode order: %w", err)
			}
			_, err := tx.Exec(ctx, `INSERT INTO `+pgx.Identifier{demoSchema, "loyalty"}.Sanitize()+` (customer_id, points)
VALUES ($1, $2) ON CONFLICT (customer_id) DO UPDATE SET points = loyalty.points + excluded.points`, o.CustomerID, o.Amount/100)
			return err
		})
	router.AddConsumerHandler("credit-points", "order", ch, func(msg *message.Message) error {
		deliveries.Add(1)
		return credit(msg)
	})
	return router, nil
}

func demoPoints(ctx context.Context, pool *pgxpool.Pool) (map[string]int, error) {
	rows, err := pool.Query(ctx, "SELECT customer_id::text, points FROM "+pgx.Identifier{demoSchema, "loyalty"}.Sanitize())
	if err != nil {
		return nil, fmt.Errorf("read points: %w", err)
	}
	m := map[string]int{}
	var c string
	var p int
	_, err = pgx.ForEachRow(rows, []any{&c, &p}, func() error { m[c] = p; return nil })
	if err != nil {
		return nil, fmt.Errorf("read points: %w", err)
	}
	return m, nil
}

// twice publishes every event two times, as a redelivering broker would.
type twice struct{ core.Publisher }

var _ core.Publisher = twice{}

func (t twice) Publish(ctx context.Context, e *core.Event) error {
	if err := t.Publisher.Publish(ctx, e); err != nil {
		return err
	}
	return t.Publisher.Publish(ctx, e)
}
