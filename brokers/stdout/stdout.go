// Package stdout is the "stdout" broker: it writes each event as one JSON
// object per line (payloads that are not JSON in base64), for trying the relay and for piping into other tools.
// A write that returns counts as published.
package stdout

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"sync"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/wm"
	"github.com/outboxhq/outbox/core"
)

func init() {
	brokers.Register("stdout", func(ctx context.Context, p brokers.Options) (core.Publisher, error) {
		var cfg struct{}
		if err := p.Config.Decode(&cfg); err != nil {
			return nil, fmt.Errorf("stdout config: %w", err)
		}
		return New(os.Stdout, p.Topics), nil
	})
}

// Line is the JSON object written for each event.
type Line struct {
	Seq         int64  `json:"seq"`
	ID          string `json:"event_id"`
	AggregateID string `json:"aggregate_id"`
	Type        string `json:"type"`
	Topic       string `json:"topic"`
	ContentType string `json:"content_type"`
	// Payload is a JSON payload as it is; PayloadBase64 holds the bytes
	// of any other content type.
	Payload       json.RawMessage   `json:"payload,omitempty"`
	PayloadBase64 []byte            `json:"payload_base64,omitempty"`
	Headers       map[string]string `json:"headers,omitempty"`
}

// Publisher writes events to an io.Writer.
type Publisher struct {
	mu     sync.Mutex
	w      io.Writer
	topics *brokers.Routing
}

var _ core.Publisher = (*Publisher)(nil)

// New returns a publisher writing to w, which it does not close.
func New(w io.Writer, topics *brokers.Routing) *Publisher {
	if topics == nil {
		topics = &brokers.Routing{}
	}
	return &Publisher{w: w, topics: topics}
}

// Publish implements core.Publisher.
func (p *Publisher) Publish(ctx context.Context, e *core.Event) error {
	topic, err := p.topics.Topic(e)
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	l := Line{Seq: e.Seq, ID: e.ID, AggregateID: e.AggregateID, Type: e.Type,
		Topic: topic, ContentType: wm.ContentType(e), Headers: e.Headers}
	if core.IsJSON(e.ContentType) {
		l.Payload = e.Payload
	} else {
		l.PayloadBase64 = e.Payload
	}
	b, err := json.Marshal(l)
	if err != nil {
		return core.Permanent(fmt.Errorf("encode event %d: %w", e.Seq, err))
	}
	b = append(b, '\n')
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, err := p.w.Write(b); err != nil {
		return fmt.Errorf("write event %d: %w", e.Seq, err)
	}
	return nil
}

// Close implements core.Publisher; the writer stays open.
func (p *Publisher) Close() error { return nil }
