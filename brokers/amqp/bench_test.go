package amqp_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/amqp"
	"github.com/outboxhq/outbox/brokers/brokertest"
	"github.com/outboxhq/outbox/brokers/wm"
	"github.com/outboxhq/outbox/core"
)

func BenchmarkPublish(b *testing.B) {
	raw := rabbitURL(b)
	prefix := fmt.Sprintf("bench%d-", time.Now().UnixNano())
	topic := prefix + "bench"
	b.Cleanup(func() { deleteQueue(b, raw, topic) })
	b.Run("adapter", func(b *testing.B) {
		pub, err := amqp.New(b.Context(), amqp.Config{URL: raw, TopicQueues: true}, &brokers.Routing{TopicPrefix: prefix}, nil)
		if err != nil {
			b.Fatal(err)
		}
		defer pub.Close()
		brokertest.Bench(b, pub)
	})
	// The Watermill publisher alone, with the same confirms and pool, on the
	// exchange and queue the adapter declared.
	b.Run("watermill", func(b *testing.B) {
		cfg := wmamqp.NewDurableTopicConfig(raw, topic, topic)
		cfg.Exchange.Durable = true
		cfg.Publish.ConfirmDelivery = true
		cfg.Publish.ChannelPoolSize = 16
		pub, err := wmamqp.NewPublisher(cfg, watermill.NopLogger{})
		if err != nil {
			b.Fatal(err)
		}
		defer pub.Close()
		brokertest.BenchFunc(b, func(lane int, seq int64) error {
			return pub.Publish(topic, wm.NewMessage(&core.Event{Seq: seq, ID: "u", AggregateID: "a", Type: "bench.event",
				Payload: []byte(`{"order_id":"o-1","amount_cents":1299,"currency":"EUR"}`)}))
		})
	})
}

func deleteQueue(t testing.TB, raw, queue string) {
	conn, err := amqp091.Dial(raw)
	if err != nil {
		t.Error(err)
		return
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Error(err)
		return
	}
	_, _ = ch.QueueDelete(queue, false, false, false)
	_ = ch.ExchangeDelete(queue, false, false)
}
