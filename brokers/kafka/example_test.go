package kafka_test

import (
	"context"
	"fmt"

	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/kafka"
	"github.com/outboxhq/outbox/core"
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
