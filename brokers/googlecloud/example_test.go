package googlecloud_test

import (
	"context"
	"fmt"
	"log"
	"log/slog"

	"github.com/ThreeDotsLabs/watermill"
	wmgc "github.com/ThreeDotsLabs/watermill-googlecloud/pkg/googlecloud"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"cloud.google.com/go/pubsub/pstest"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/googlecloud"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/dedupe"
)

func ExampleNew() {
	// An in-process fake stands in for Google's emulator or the service.
	srv := pstest.NewServer()
	defer srv.Close()

	ctx := context.Background()
	pub, err := googlecloud.New(ctx, googlecloud.Config{
		ProjectID: "my-project", EmulatorHost: srv.Addr, CreateTopics: true,
	}, &brokers.Routing{}, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pub.Close()
	err = pub.Publish(ctx, &core.Event{Seq: 1, ID: "0b7e5c8e-0000-4000-8000-000000000001",
		AggregateID: "order-7", Type: "order.placed", Payload: []byte(`{"total":12}`)})
	m := srv.Messages()[0]
	fmt.Println(err, m.Topic, m.OrderingKey)
	// Output: <nil> projects/my-project/topics/order order-7
}

// The billing service reads topic "order" through its own subscription,
// "order.billing", with message ordering on. Needs Pub/Sub, so it is
// compiled but not run.
func ExampleSubscriberConfig() {
	cfg, err := googlecloud.SubscriberConfig(googlecloud.Config{ProjectID: "my-project"}, "billing")
	if err != nil {
		log.Fatal(err)
	}
	sub, err := wmgc.NewSubscriber(cfg, watermill.NewSlogLogger(slog.Default()))
	if err != nil {
		log.Fatal(err)
	}

	// The service's router, and its Deduper named "billing" as well.
	var router *message.Router
	var d *dedupe.Deduper[pgx.Tx]
	var handler dedupe.NoPublishHandlerFunc[pgx.Tx]
	router.AddConsumerHandler("billing", "order", sub, d.NoPublishHandler(handler))
}
