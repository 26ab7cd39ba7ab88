// Package wm adapts any Watermill message.Publisher to core.Publisher: it
// turns an outbox event into a Watermill message (UUID = the event's uid,
// payload = the stored bytes, metadata = the event's headers plus the relay's
// identity headers) and publishes it on the routed topic.
package wm

import (
	"context"
	"fmt"
	"strconv"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/core"
)

// Classifier tells a broker's permanent errors from transient ones; it
// returns err itself, or core.Permanent(err).
type Classifier func(err error) error

// Publisher publishes events through a Watermill publisher.
type Publisher struct {
	pub      message.Publisher
	topics   *brokers.Routing
	classify Classifier
}

var _ core.Publisher = (*Publisher)(nil)

// New wraps pub. classify may be nil (every publish error is transient).
func New(pub message.Publisher, topics *brokers.Routing, classify Classifier) *Publisher {
	if topics == nil {
		topics = &brokers.Routing{}
	}
	if classify == nil {
		classify = func(err error) error { return err }
	}
	return &Publisher{pub: pub, topics: topics, classify: classify}
}

// Message builds the Watermill message for e.
func Message(e *core.Event) *message.Message {
	msg := message.NewMessage(e.UID, e.Payload)
	for k, v := range e.Headers {
		msg.Metadata.Set(k, v)
	}
	msg.Metadata.Set(core.HeaderEventUID, e.UID)
	msg.Metadata.Set(core.HeaderEventID, strconv.FormatInt(e.ID, 10))
	msg.Metadata.Set(core.HeaderType, e.Type)
	msg.Metadata.Set(core.HeaderAggregateID, e.AggregateID)
	return msg
}

// Publish implements core.Publisher. Watermill publishers do not all honour
// a context, so the publish runs aside and a cancelled ctx returns at once;
// the event then counts as not published and is retried (at-least-once).
func (p *Publisher) Publish(ctx context.Context, e *core.Event) error {
	topic, err := p.topics.Topic(e)
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	msg := Message(e)
	msg.SetContext(ctx)
	done := make(chan error, 1)
	go func() { done <- p.pub.Publish(topic, msg) }()
	select {
	case err := <-done:
		if err != nil {
			return p.classify(fmt.Errorf("publish to %s: %w", topic, err))
		}
		return nil
	case <-ctx.Done():
		return fmt.Errorf("publish to %s: %w", topic, ctx.Err())
	}
}

// Close closes the Watermill publisher.
func (p *Publisher) Close() error { return p.pub.Close() }
