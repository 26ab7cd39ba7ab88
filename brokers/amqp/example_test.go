package amqp_test

import (
	"context"
	"log"
	"log/slog"
	"os"

	"github.com/ThreeDotsLabs/watermill"
	wmamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/amqp"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/dedupe"
)

// Needs a RabbitMQ server, so it is compiled but not run.
func ExampleNew() {
	ctx := context.Background()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	pub, err := amqp.New(ctx, amqp.Config{
		URL:  "amqp://rabbit.internal:5672/",
		User: "relay", Password: os.Getenv("RABBITMQ_PASSWORD"),
	}, &brokers.Routing{}, log)
	if err != nil {
		log.Error("open broker", "error", err)
		return
	}
	defer pub.Close()
	// Declares exchange "order", then returns once RabbitMQ confirms the
	// persistent message; with no queue bound to receive it, it fails
	// with amqp.ErrNoQueue and the relay retries the event.
	_ = pub.Publish(ctx, &core.Event{Seq: 1, ID: "0b7e5c8e-0000-4000-8000-000000000001",
		AggregateID: "order-7", Type: "order.placed", Payload: []byte(`{"total":12}`)})
}

// The billing service reads topic "order" from its own queue,
// "order.billing", bound to the relay's exchange "order". Needs a RabbitMQ
// server, so it is compiled but not run.
func ExampleSubscriberConfig() {
	cfg, err := amqp.SubscriberConfig(amqp.Config{
		URL:  "amqp://rabbit.internal:5672/",
		User: "billing", Password: os.Getenv("RABBITMQ_PASSWORD"),
	}, "billing")
	if err != nil {
		log.Fatal(err)
	}
	sub, err := wmamqp.NewSubscriber(cfg, watermill.NewSlogLogger(slog.Default()))
	if err != nil {
		log.Fatal(err)
	}

	// The service's router, and its Deduper named "billing" as well.
	var router *message.Router
	var d *dedupe.Deduper[pgx.Tx]
	var handler dedupe.NoPublishHandlerFunc[pgx.Tx]
	router.AddConsumerHandler("billing", "order", sub, d.NoPublishHandler(handler))
}
