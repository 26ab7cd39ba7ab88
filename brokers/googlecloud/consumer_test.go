package googlecloud_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	wmgc "github.com/ThreeDotsLabs/watermill-googlecloud/pkg/googlecloud"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/brokertest"
	"github.com/outboxhq/outbox/brokers/googlecloud"
	"github.com/outboxhq/outbox/core"
)

// Two services, each its own ordered subscription built by
// SubscriberConfig, take every relayed event once and in order per
// aggregate.
func TestConsumers(t *testing.T) {
	srv := server(t)
	cfg := googlecloud.Config{ProjectID: project, EmulatorHost: srv.Addr, CreateTopics: true}
	brokertest.RunConsumers(t, brokertest.ConsumerHarness{
		Publisher: func(t *testing.T, r *brokers.Routing) core.Publisher {
			pub, err := googlecloud.New(t.Context(), cfg, r, nil)
			if err != nil {
				t.Fatal(err)
			}
			return pub
		},
		Subscriber: func(t *testing.T, service string) message.Subscriber {
			sc, err := googlecloud.SubscriberConfig(cfg, service)
			if err != nil {
				t.Fatal(err)
			}
			sub, err := wmgc.NewSubscriber(sc, watermill.NopLogger{})
			if err != nil {
				t.Fatal(err)
			}
			return sub
		},
	})
}

func TestSubscriberConfigRefusesBadInput(t *testing.T) {
	if _, err := googlecloud.SubscriberConfig(googlecloud.Config{}, "billing"); err == nil {
		t.Error("SubscriberConfig without a project succeeded")
	}
	if _, err := googlecloud.SubscriberConfig(googlecloud.Config{ProjectID: "p"}, "a b"); err == nil {
		t.Error("SubscriberConfig with a space in the service succeeded")
	}
}
