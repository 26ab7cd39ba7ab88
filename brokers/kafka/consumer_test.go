package kafka_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kgo"

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

// A subscriber built by SubscriberConfig reads only committed
// transactions: the records of an aborted one never reach the handler.
func TestSubscriberReadsOnlyCommittedTransactions(t *testing.T) {
	kf := cluster(t)
	ctx := t.Context()
	cl, err := kgo.NewClient(kgo.SeedBrokers(kf.ListenAddrs()...), kgo.TransactionalID("test-aborts"),
		kgo.DefaultProduceTopic("order"), kgo.AllowAutoTopicCreation())
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	produce := func(value string, commit kgo.TransactionEndTry) {
		t.Helper()
		if err := cl.BeginTransaction(); err != nil {
			t.Fatal(err)
		}
		if err := cl.ProduceSync(ctx, &kgo.Record{Key: []byte("a-1"), Value: []byte(value)}).FirstErr(); err != nil {
			t.Fatal(err)
		}
		if err := cl.EndTransaction(ctx, commit); err != nil {
			t.Fatal(err)
		}
	}
	produce(`"aborted"`, kgo.TryAbort)
	produce(`"committed"`, kgo.TryCommit)

	cfg, err := kafka.SubscriberConfig(kafka.Config{Brokers: kf.ListenAddrs()}, "billing")
	if err != nil {
		t.Fatal(err)
	}
	sub, err := wmkafka.NewSubscriber(cfg, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	msgs, err := sub.Subscribe(ctx, "order")
	if err != nil {
		t.Fatal(err)
	}
	select {
	case m := <-msgs:
		m.Ack()
		if got := string(m.Payload); got != `"committed"` {
			t.Fatalf("first message read is %s, want the committed one", got)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("no message in 20s")
	}
}
