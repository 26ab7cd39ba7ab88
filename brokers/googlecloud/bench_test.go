package googlecloud_test

import (
	"testing"

	//lint:ignore SA1019 watermill-googlecloud v1.2.1 is built on pubsub v1, whose types it takes
	"cloud.google.com/go/pubsub"
	"github.com/ThreeDotsLabs/watermill"
	wmgc "github.com/ThreeDotsLabs/watermill-googlecloud/pkg/googlecloud"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxhq/outbox/brokers/brokertest"
	"github.com/outboxhq/outbox/brokers/googlecloud"
	"github.com/outboxhq/outbox/brokers/wm"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
)

func BenchmarkPublish(b *testing.B) {
	srv := server(b)
	s := googlecloud.Config{ProjectID: project, EmulatorHost: srv.Addr, CreateTopics: true}
	b.Run("adapter", func(b *testing.B) {
		pub, err := googlecloud.New(b.Context(), s, nil, nil)
		if err != nil {
			b.Fatal(err)
		}
		defer pub.Close()
		brokertest.Bench(b, pub)
	})
	// The Watermill publisher with the client's default batching, on the
	// topic the adapter created.
	b.Run("watermill-default-batching", func(b *testing.B) {
		benchWatermill(b, srv.Addr, nil)
	})
	b.Run("watermill-adapter-batching", func(b *testing.B) {
		ps := pubsub.DefaultPublishSettings
		ps.DelayThreshold, ps.CountThreshold = 50e3, 1
		benchWatermill(b, srv.Addr, &ps)
	})
}

func benchWatermill(b *testing.B, addr string, ps *pubsub.PublishSettings) {
	b.Setenv("PUBSUB_EMULATOR_HOST", addr)
	pub, err := wmgc.NewPublisher(wmgc.PublisherConfig{
		ProjectID: project, EnableMessageOrdering: true, PublishSettings: ps,
		Marshaler: wmgc.NewOrderingMarshaler(func(_ string, m *message.Message) (string, error) {
			return m.Metadata.Get(event.HeaderAggregateID), nil
		}),
	}, watermill.NopLogger{})
	if err != nil {
		b.Fatal(err)
	}
	defer pub.Close()
	brokertest.BenchFunc(b, func(lane int, seq int64) error {
		return pub.Publish("bench", wm.NewMessage(&core.Event{Seq: seq, ID: "u", AggregateID: "a" + string(rune('a'+lane)),
			Type: "bench.event", Payload: []byte(`{"order_id":"o-1","amount_cents":1299,"currency":"EUR"}`)}))
	})
}
