package wm_test

import (
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxhq/outbox/brokers/wm"
)

// slow blocks each publish until release is closed and records Close.
type slow struct {
	entered chan struct{}
	release chan struct{}
	closed  chan struct{}
}

func (s *slow) Publish(string, ...*message.Message) error {
	s.entered <- struct{}{}
	<-s.release
	return nil
}

func (s *slow) Close() error { close(s.closed); return nil }

func TestGuardCloseWaitsForPublish(t *testing.T) {
	s := &slow{entered: make(chan struct{}), release: make(chan struct{}), closed: make(chan struct{})}
	g := wm.Guard(s)
	published := make(chan error)
	go func() { published <- g.Publish("t", message.NewMessage("u", nil)) }()
	<-s.entered
	closed := make(chan error)
	go func() { closed <- g.Close() }()
	select {
	case <-s.closed:
		t.Fatal("Close reached the publisher while a publish was running")
	case <-time.After(50 * time.Millisecond):
	}
	close(s.release)
	if err := <-published; err != nil {
		t.Fatal(err)
	}
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	if err := g.Publish("t", message.NewMessage("u", nil)); !errors.Is(err, wm.ErrClosed) {
		t.Fatalf("publish after Close: %v, want ErrClosed", err)
	}
	if err := g.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}
