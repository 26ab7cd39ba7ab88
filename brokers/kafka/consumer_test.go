package kafka_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	wmkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/brokertest"
	"github.com/outboxhq/outbox/brokers/kafka"
	"github.com/outboxhq/outbox/core"
)

// Two services, each its own consumer group built by SubscriberConfig,
// take every relayed event once and in order per aggregate, over four
// partitions.
func TestConsumers(t *testing.T) {
	kf := cluster(t)
	brokertest.RunConsumers(t, brokertest.ConsumerHarness{
		Publisher: func(t *testing.T, r *brokers.Routing) core.Publisher {
			pub, err := kafka.New(t.Context(), kafka.Config{Brokers: kf.ListenAddrs()}, r, nil)
			if err != nil {
				t.Fatal(err)
			}
			return pub
		},
		Subscriber: func(t *testing.T, service string) message.Subscriber {
			cfg, err := kafka.SubscriberConfig(kafka.Config{Brokers: kf.ListenAddrs()}, service)
			if err != nil {
				t.Fatal(err)
			}
			sub, err := wmkafka.NewSubscriber(cfg, watermill.NopLogger{})
			if err != nil {
				t.Fatal(err)
			}
			return sub
		},
	})
}

func TestSubscriberConfigRefusesBadInput(t *testing.T) {
	if _, err := kafka.SubscriberConfig(kafka.Config{}, "billing"); err == nil {
		t.Error("SubscriberConfig without brokers succeeded")
	}
	if _, err := kafka.SubscriberConfig(kafka.Config{Brokers: []string{"h:9092"}}, ""); err == nil {
		t.Error("SubscriberConfig without a service succeeded")
	}
}
