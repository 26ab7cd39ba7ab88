package wm_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/wm"
	"github.com/outboxhq/outbox/core"
)

// down is a Watermill publisher whose broker takes nothing.
type down struct{}

func (down) Publish(string, ...*message.Message) error { return errors.New("connection refused") }
func (down) Close() error                              { return nil }

// A publisher from New does not claim its broker answers: without a way
// to ask it, Ping reports it cannot tell (errors.ErrUnsupported), which
// no caller takes for an answer; with WithPing it asks. It used to answer
// nil during a full outage, so the log relay moved events to the table.
func TestNewPingAsksOrSaysItCannot(t *testing.T) {
	ctx := context.Background()
	p := wm.New(down{}, &brokers.Routing{Fixed: "t"}, nil)
	if err := p.Publish(ctx, &core.Event{ID: "e", AggregateID: "a"}); err == nil {
		t.Fatal("publish to a broker that is down succeeded")
	}
	if err := p.Ping(ctx); err == nil || !errors.Is(err, errors.ErrUnsupported) {
		t.Fatalf("Ping = %v, want an error wrapping errors.ErrUnsupported", err)
	}
	refused := errors.New("connection refused")
	asked := 0
	p = wm.New(down{}, nil, nil).WithPing(func(context.Context) error { asked++; return refused })
	if err := p.Ping(ctx); !errors.Is(err, refused) || asked != 1 {
		t.Fatalf("Ping with WithPing = %v after %d asks, want the broker's answer", err, asked)
	}
}
