package amqp_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	wmamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/amqp"
	"github.com/outboxhq/outbox/brokers/brokertest"
	"github.com/outboxhq/outbox/core"
)

// Two services, each on its own queue built by SubscriberConfig, take
// every relayed event once and in order per aggregate. The relay runs
// passive, as docs/consumers.md advises once services have queues: the
// exchange it publishes to is the one the subscribers declared.
func TestConsumers(t *testing.T) {
	raw := rabbitURL(t)
	brokertest.RunConsumers(t, brokertest.ConsumerHarness{
		Publisher: func(t *testing.T, r *brokers.Routing) core.Publisher {
			pub, err := amqp.New(t.Context(), amqp.Config{URL: raw, Passive: true}, r, nil)
			if err != nil {
				t.Fatal(err)
			}
			return pub
		},
		Subscriber: func(t *testing.T, service string) message.Subscriber {
			cfg, err := amqp.SubscriberConfig(amqp.Config{URL: raw}, service)
			if err != nil {
				t.Fatal(err)
			}
			sub, err := wmamqp.NewSubscriber(cfg, watermill.NopLogger{})
			if err != nil {
				t.Fatal(err)
			}
			return sub
		},
	})
}

func TestSubscriberConfigRefusesBadInput(t *testing.T) {
	if _, err := amqp.SubscriberConfig(amqp.Config{}, "billing"); err == nil {
		t.Error("SubscriberConfig without a URL succeeded")
	}
	for _, svc := range []string{"", "bill ing", "order.billing", "9lives"} {
		if _, err := amqp.SubscriberConfig(amqp.Config{URL: "amqp://h:5672/"}, svc); err == nil {
			t.Errorf("SubscriberConfig(service %q) succeeded", svc)
		}
	}
}
