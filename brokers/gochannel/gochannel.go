// Package gochannel is the "gochannel" broker: Watermill's in-process
// GoChannel pub/sub, for library use, tests and the demo. Nothing leaves the
// process, so it only makes sense when the consumers run in it too:
// subscribe them to Shared().
package gochannel

import (
	"context"
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
	wmgo "github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/wm"
	"github.com/outboxhq/outbox/core"
)

var (
	sharedOnce sync.Once
	shared     *wmgo.GoChannel
)

// Shared is the process-wide GoChannel the registered "gochannel" broker
// publishes to. Subscribe consumers to it before messages are published:
// GoChannel does not keep messages for later subscribers, and a publish
// with no subscriber succeeds with nobody receiving it.
//
// A publish waits until every subscriber has acked: without that, GoChannel
// hands each message over on its own goroutine and per-key order is lost.
func Shared() *wmgo.GoChannel {
	sharedOnce.Do(func() {
		shared = wmgo.NewGoChannel(wmgo.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	})
	return shared
}

func init() {
	brokers.Register("gochannel", func(ctx context.Context, p brokers.Options) (core.Publisher, error) {
		var none struct{}
		if err := p.Config.Decode(&none); err != nil {
			return nil, fmt.Errorf("gochannel config: %w", err)
		}
		return New(Shared(), p.Topics), nil
	})
}

// New publishes to ch. Close leaves ch open: its owner closes it.
func New(ch *wmgo.GoChannel, topics *brokers.Routing) core.Publisher {
	// In process: the channel is the broker, and it always answers.
	return keepOpen{wm.New(ch, topics, nil).WithPing(func(context.Context) error { return nil })}
}

type keepOpen struct{ *wm.Publisher }

var _ core.Publisher = keepOpen{}

func (keepOpen) Close() error { return nil }
