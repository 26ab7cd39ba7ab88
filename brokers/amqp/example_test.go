package amqp_test

import (
	"context"
	"log/slog"
	"os"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/amqp"
	"github.com/outboxhq/outbox/core"
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
	// Declares exchange "order" and queue "order", then returns once
	// RabbitMQ confirms the persistent message.
	_ = pub.Publish(ctx, &core.Event{Seq: 1, ID: "0b7e5c8e-0000-4000-8000-000000000001",
		AggregateID: "order-7", Type: "order.placed", Payload: []byte(`{"total":12}`)})
}
