package wm

import (
	"errors"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
)

// ErrClosed is returned by a guarded publisher after Close.
var ErrClosed = errors.New("publisher is closed")

// Guard makes Close wait for in-flight publishes and later publishes fail
// with ErrClosed. Several Watermill publishers keep their closed state in a
// plain field and release their client under a running publish; the relay
// may still have a publish running when it closes its publisher.
func Guard(pub message.Publisher) message.Publisher { return &guarded{pub: pub} }

type guarded struct {
	pub    message.Publisher
	mu     sync.RWMutex
	closed bool
}

var _ message.Publisher = (*guarded)(nil)

func (g *guarded) Publish(topic string, msgs ...*message.Message) error {
	g.mu.RLock()
	defer g.mu.RUnlock()
	if g.closed {
		return ErrClosed
	}
	return g.pub.Publish(topic, msgs...)
}

func (g *guarded) Close() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return nil
	}
	g.closed = true
	return g.pub.Close()
}
