// Package wm adapts any Watermill message.Publisher to core.Publisher: it
// turns an outbox event into a Watermill message (UUID = the event id,
// payload = the stored bytes, metadata = the event's headers plus the relay's
// identity headers and the content type) and publishes it on the routed topic.
//
// New wraps one publisher as it is. Open wraps a broker connection that it
// dials itself and replaces when it wedges or drops: the broker adapters
// use it, so that every publish, ping and Close is bounded whatever the
// broker does.
package wm

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
)

// Classifier tells a broker's permanent errors from transient ones; it
// returns err itself, or core.Permanent(err).
type Classifier func(err error) error

// ErrCannotPing is what Ping returns for a publisher from New without
// WithPing: it wraps errors.ErrUnsupported, so the relays count the
// broker as neither up nor down, never as answering.
var ErrCannotPing = fmt.Errorf("publisher from wm.New has no way to ask its broker (see WithPing): %w", errors.ErrUnsupported)

// Publisher publishes events through a Watermill publisher.
type Publisher struct {
	pub      message.Publisher               // New: the one publisher
	ping     func(ctx context.Context) error // New: asks pub's broker, when set
	guard    *guard                          // Open: the live link, replaced when it wedges
	topics   *brokers.Routing
	classify Classifier
}

var (
	_ core.Publisher = (*Publisher)(nil)
	_ core.Pinger    = (*Publisher)(nil)
)

// New wraps pub. classify may be nil (every publish error is transient).
func New(pub message.Publisher, topics *brokers.Routing, classify Classifier) *Publisher {
	p := &Publisher{pub: pub}
	p.init(topics, classify)
	return p
}

// Open dials the first link, bounded by opts.DialTimeout and ctx, and
// returns a publisher over it that replaces the link when it wedges or
// drops (see Options.Broken). The publisher implements core.Pinger.
func Open(ctx context.Context, dial Dialer, topics *brokers.Routing, classify Classifier, opts Options) (*Publisher, error) {
	g := newGuard(dial, opts)
	if _, err := g.current(ctx); err != nil {
		// Whatever the dial left (an abandoned attempt) ends aside; the
		// caller is told now.
		g.mu.Lock()
		g.closed = true
		g.mu.Unlock()
		g.cancel()
		return nil, err
	}
	p := &Publisher{guard: g}
	p.init(topics, classify)
	return p, nil
}

func (p *Publisher) init(topics *brokers.Routing, classify Classifier) {
	if topics == nil {
		topics = &brokers.Routing{}
	}
	if classify == nil {
		classify = func(err error) error { return err }
	}
	p.topics, p.classify = topics, classify
}

// NewMessage builds the Watermill message for e.
func NewMessage(e *core.Event) *message.Message {
	msg := message.NewMessage(e.ID, e.Payload)
	for k, v := range e.Headers {
		msg.Metadata.Set(k, v)
	}
	msg.Metadata.Set(event.HeaderEventID, e.ID)
	msg.Metadata.Set(event.HeaderEventUID, e.ID)
	msg.Metadata.Set(event.HeaderEventSeq, strconv.FormatInt(e.Seq, 10))
	msg.Metadata.Set(event.HeaderType, e.Type)
	msg.Metadata.Set(event.HeaderAggregateID, e.AggregateID)
	msg.Metadata.Set(event.HeaderContentType, ContentType(e))
	return msg
}

// ContentType is e's content type, application/json when it has none.
func ContentType(e *core.Event) string {
	if e.ContentType == "" {
		return event.ContentTypeJSON
	}
	return e.ContentType
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
	msg := NewMessage(e)
	msg.SetContext(ctx)
	if p.guard != nil {
		err = p.guard.publish(ctx, topic, msg)
	} else {
		err = aside(ctx, func() error {
			return contain("publish", func() error { return p.pub.Publish(topic, msg) })
		})
	}
	switch {
	case err == nil:
		return nil
	case ctx.Err() != nil && errors.Is(err, ctx.Err()):
		return fmt.Errorf("publish to %s: %w", topic, err)
	default:
		return p.classify(fmt.Errorf("publish to %s: %w", topic, err))
	}
}

// aside runs fn on its own goroutine and returns when it does or ctx ends.
func aside(ctx context.Context, fn func() error) error {
	done := make(chan error, 1)
	go func() { done <- fn() }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// WithPing sets how a publisher from New asks its broker, and returns p.
// Set it before p is used.
func (p *Publisher) WithPing(ping func(ctx context.Context) error) *Publisher {
	p.ping = ping
	return p
}

// Ping implements core.Pinger: it checks the broker over the live link,
// dialing one when the last was torn down. A publisher from New asks with
// the function given to WithPing; without one it cannot ask and returns
// ErrCannotPing, never a nil that would claim the broker answers.
func (p *Publisher) Ping(ctx context.Context) error {
	if p.guard == nil {
		if p.ping == nil {
			return ErrCannotPing
		}
		if err := aside(ctx, func() error { return contain("ping", func() error { return p.ping(ctx) }) }); err != nil {
			return fmt.Errorf("ping broker: %w", err)
		}
		return nil
	}
	if err := p.guard.ping(ctx); err != nil {
		return fmt.Errorf("ping broker: %w", err)
	}
	return nil
}

// Close closes the Watermill publisher. A publisher from Open waits for
// calls in flight until halfway through Options.CloseTimeout, then aborts
// its connection to end them, and returns by CloseTimeout whatever the
// broker does.
func (p *Publisher) Close() error {
	if p.guard != nil {
		return p.guard.close()
	}
	return contain("close publisher", p.pub.Close)
}
