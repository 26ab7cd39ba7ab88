package brokers_test

import (
	"context"
	"fmt"
	"log/slog"
	"sync"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/core"
)

// WebhookConfig is the custom publisher's own configuration section,
// brokers.webhook in YAML. Flat keys map to environment variables
// OUTBOX_BROKERS_WEBHOOK_<KEY>.
type WebhookConfig struct {
	URL string `koanf:"url"`
}

func init() {
	brokers.Register("webhook", func(ctx context.Context, p brokers.Options) (core.Publisher, error) {
		var s WebhookConfig
		if err := p.Config.Decode(&s); err != nil {
			return nil, fmt.Errorf("webhook config: %w", err)
		}
		if s.URL == "" {
			return nil, fmt.Errorf("webhook: url is empty")
		}
		p.Logger.Info("webhook publisher ready") // never log credentials
		return &webhook{url: s.URL, topics: p.Topics}, nil
	})
}

// webhook stands in for a publisher of your own: it must return nil only
// once the receiver has the event, and be safe for concurrent use.
type webhook struct {
	url    string
	topics *brokers.Routing
	mu     sync.Mutex
	sent   []string
}

func (w *webhook) Publish(ctx context.Context, e *core.Event) error {
	topic, err := w.topics.Topic(e) // a type with no route is a permanent error
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.sent = append(w.sent, fmt.Sprintf("POST %s/%s key=%s %s", w.url, topic, e.AggregateID, e.Payload))
	return nil
}

func (w *webhook) Close() error { return nil }

// A binary registers its publisher in an init function, as here, and
// selects it in YAML:
//
//	broker: webhook
//	brokers:
//	  webhook:
//	    url: https://hooks.example.com
func Example_customPublisher() {
	// What the CLI does with the configuration above.
	section := brokers.DecoderFunc(func(v any) error {
		*(v.(*WebhookConfig)) = WebhookConfig{URL: "https://hooks.example.com"}
		return nil
	})
	pub, err := brokers.Open(context.Background(), "webhook", brokers.Options{
		Config: section, Topics: &brokers.Routing{}, Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pub.Close()
	_ = pub.Publish(context.Background(), &core.Event{Seq: 1, AggregateID: "order-7", Type: "order.placed", Payload: []byte(`{"total":12}`)})
	fmt.Println(pub.(*webhook).sent[0])
	// Output: POST https://hooks.example.com/order key=order-7 {"total":12}
}
