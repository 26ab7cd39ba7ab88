package gochannel_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmgo "github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"go.uber.org/goleak"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/brokertest"
	"github.com/outboxhq/outbox/brokers/gochannel"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// collector subscribes to topics before anything is published (GoChannel
// keeps nothing for later subscribers) and records arrivals per topic.
type collector struct {
	mu   sync.Mutex
	got  map[string][]brokertest.Received
	wake chan struct{}
	wg   sync.WaitGroup
}

func subscribe(t *testing.T, ch *wmgo.GoChannel, topics []string) *collector {
	c := &collector{got: map[string][]brokertest.Received{}, wake: make(chan struct{}, 1)}
	ctx, cancel := context.WithCancel(context.Background())
	for _, topic := range topics {
		msgs, err := ch.Subscribe(ctx, topic)
		if err != nil {
			t.Fatalf("subscribe %s: %v", topic, err)
		}
		c.wg.Add(1)
		go func() {
			defer c.wg.Done()
			for m := range msgs {
				c.mu.Lock()
				c.got[topic] = append(c.got[topic], toMessage(m))
				c.mu.Unlock()
				m.Ack()
				select {
				case c.wake <- struct{}{}:
				default:
				}
			}
		}()
	}
	t.Cleanup(func() { cancel(); _ = ch.Close(); c.wg.Wait() })
	return c
}

func (c *collector) read(t *testing.T, topic string, n int) []brokertest.Received {
	deadline := time.After(10 * time.Second)
	for {
		c.mu.Lock()
		got := c.got[topic]
		c.mu.Unlock()
		if len(got) >= n {
			return got[:n]
		}
		select {
		case <-c.wake:
		case <-time.After(10 * time.Millisecond):
		case <-deadline:
			t.Fatalf("topic %s: %d messages, want %d", topic, len(got), n)
		}
	}
}

func TestConformance(t *testing.T) {
	var (
		ch   *wmgo.GoChannel
		recv *collector
	)
	brokertest.Run(t, brokertest.Harness{
		Open: func(t *testing.T, r *brokers.Routing, topics []string) core.Publisher {
			// GoChannel hands each message to its subscribers on a goroutine
			// of its own; only waiting for their ack keeps per-key order.
			ch = wmgo.NewGoChannel(wmgo.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
			recv = subscribe(t, ch, topics)
			return gochannel.New(ch, r)
		},
		Read:  func(t *testing.T, topic string, n int) []brokertest.Received { return recv.read(t, topic, n) },
		Stop:  func(t *testing.T, _ core.Publisher) { _ = ch.Close() },
		NoKey: true,
	})
}

func toMessage(m *message.Message) brokertest.Received {
	h := make(map[string]string, len(m.Metadata))
	for k, v := range m.Metadata {
		h[k] = v
	}
	return brokertest.Received{Headers: h, ContentType: h[event.HeaderContentType], Body: m.Payload}
}
