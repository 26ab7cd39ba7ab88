package kafka_test

import (
	"context"
	"fmt"
	"log"
	"log/slog"
	"os"

	"github.com/ThreeDotsLabs/watermill"
	wmkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/kafka"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/dedupe"
)

func ExampleNew() {
	// An in-process cluster stands in for yours.
	kf, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.AllowAutoTopicCreation())
	if err != nil {
		fmt.Println(err)
		return
	}
	defer kf.Close()

	ctx := context.Background()
	pub, err := kafka.New(ctx, kafka.Config{Brokers: kf.ListenAddrs()},
		&brokers.Routing{Types: map[string]string{"order.refunded": "payments"}}, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pub.Close()
	err = pub.Publish(ctx, &core.Event{Seq: 1, ID: "0b7e5c8e-0000-4000-8000-000000000001",
		AggregateID: "order-7", Type: "order.placed", Payload: []byte(`{"total":12}`)})
	fmt.Println("published:", err == nil)
	// Output: published: true
}

// The billing service reads topic "order" in its own consumer group,
// "billing". Needs a Kafka cluster, so it is compiled but not run.
func ExampleSubscriberConfig() {
	cfg, err := kafka.SubscriberConfig(kafka.Config{
		Brokers:       []string{"kafka-1.internal:9092", "kafka-2.internal:9092"},
		SASLMechanism: "SCRAM-SHA-512", SASLUser: "billing", SASLPassword: os.Getenv("KAFKA_PASSWORD"),
	}, "billing")
	if err != nil {
		log.Fatal(err)
	}
	sub, err := wmkafka.NewSubscriber(cfg, watermill.NewSlogLogger(slog.Default()))
	if err != nil {
		log.Fatal(err)
	}

	// The service's router, and its Deduper named "billing" as well.
	var router *message.Router
	var d *dedupe.Deduper[pgx.Tx]
	var handler dedupe.NoPublishHandlerFunc[pgx.Tx]
	router.AddConsumerHandler("billing", "order", sub, d.NoPublishHandler(handler))
}
