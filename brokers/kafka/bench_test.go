package kafka_test

import (
	"testing"

	"github.com/IBM/sarama"
	wmkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxhq/outbox/brokers/brokertest"
	"github.com/outboxhq/outbox/brokers/kafka"
	"github.com/outboxhq/outbox/brokers/wm"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
)

func BenchmarkPublish(b *testing.B) {
	kf := cluster(b)
	b.Run("adapter", func(b *testing.B) {
		pub, err := kafka.New(b.Context(), kafka.Config{Brokers: kf.ListenAddrs()}, nil, nil)
		if err != nil {
			b.Fatal(err)
		}
		defer pub.Close()
		brokertest.Bench(b, pub)
	})
	// The Watermill publisher alone, with the same producer settings.
	b.Run("watermill", func(b *testing.B) {
		cfg := wmkafka.DefaultSaramaSyncPublisherConfig()
		cfg.Producer.RequiredAcks = sarama.WaitForAll
		cfg.Producer.Idempotent = true
		cfg.Net.MaxOpenRequests = 1
		cfg.Version = sarama.DefaultVersion
		pub, err := wmkafka.NewPublisher(wmkafka.PublisherConfig{
			Brokers: kf.ListenAddrs(), OverwriteSaramaConfig: cfg,
			Marshaler: wmkafka.NewWithPartitioningMarshaler(func(_ string, m *message.Message) (string, error) {
				return m.Metadata.Get(event.HeaderAggregateID), nil
			}),
		}, nil)
		if err != nil {
			b.Fatal(err)
		}
		defer pub.Close()
		brokertest.BenchFunc(b, func(lane int, seq int64) error {
			return pub.Publish("bench", wm.NewMessage(benchEvent(lane, seq)))
		})
	})
}

func benchEvent(lane int, seq int64) *core.Event {
	return &core.Event{Seq: seq, ID: "00000000-0000-4000-8000-000000000000", AggregateID: "lane-" + string(rune('a'+lane)),
		Type: "bench.event", Payload: []byte(`{"order_id":"o-1","amount_cents":1299,"currency":"EUR"}`)}
}
