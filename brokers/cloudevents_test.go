package brokers_test

import (
	"context"
	"errors"
	"testing"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/core"
)

// keeper keeps the events it publishes.
type keeper struct{ got []core.Event }

func (k *keeper) Publish(_ context.Context, e *core.Event) error {
	k.got = append(k.got, *e)
	return nil
}
func (k *keeper) Close() error { return nil }

type pingKeeper struct{ keeper }

func (*pingKeeper) Ping(context.Context) error { return nil }

// binder binds to a source, returning bound.
type binder struct {
	keeper
	bound core.Publisher
	src   core.Source
	err   error
}

func (b *binder) Bind(src core.Source) (core.Publisher, error) {
	b.src = src
	return b.bound, b.err
}

type pingBinder struct{ binder }

func (*pingBinder) Ping(context.Context) error { return nil }

// The CloudEvents wrapper of a Binder binds the publisher it wraps, and
// what the bound one publishes carries the attributes.
func TestCloudEventsForwardsBind(t *testing.T) {
	ce := brokers.CloudEvents{Source: "/shop"}
	b := brokers.CloudEventsBinding{Prefix: "ce_"}
	bound := &pingKeeper{}
	inner := &binder{bound: bound}
	pub, err := brokers.WithCloudEvents(inner, ce, b)
	if err != nil {
		t.Fatal(err)
	}
	bd, ok := pub.(core.Binder)
	if !ok {
		t.Fatal("wrapped Binder lost Bind")
	}
	if _, ok := pub.(core.Pinger); ok {
		t.Error("a Binder without Ping gained one")
	}
	src := struct{ core.Source }{}
	got, err := bd.Bind(src)
	if err != nil {
		t.Fatal(err)
	}
	if inner.src != src {
		t.Error("Bind did not reach the wrapped publisher")
	}
	if _, ok := got.(core.Pinger); !ok {
		t.Error("the bound publisher lost Ping")
	}
	if err := got.Publish(context.Background(), &core.Event{ID: "e1", Type: "order.placed"}); err != nil {
		t.Fatal(err)
	}
	if len(bound.got) != 1 || bound.got[0].Headers["ce_id"] != "e1" || bound.got[0].Headers["ce_source"] != "/shop" {
		t.Fatalf("bound publisher got %+v, want one event with the CloudEvents attributes", bound.got)
	}
	if len(inner.got) != 0 {
		t.Error("the unbound publisher published")
	}

	both, err := brokers.WithCloudEvents(&pingBinder{binder{bound: &keeper{}}}, ce, b)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := both.(core.Pinger); !ok {
		t.Error("a pinging Binder lost Ping")
	}
	if _, ok := both.(core.Binder); !ok {
		t.Error("a pinging Binder lost Bind")
	}
	refused, err := brokers.WithCloudEvents(&binder{err: errors.New("no settler")}, ce, b)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := refused.(core.Binder).Bind(src); err == nil || err.Error() != "no settler" {
		t.Errorf("Bind error = %v, want the wrapped publisher's", err)
	}
	plain, err := brokers.WithCloudEvents(&keeper{}, ce, b)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := plain.(core.Binder); ok {
		t.Error("a publisher without Bind gained one")
	}
}

// committerPub says every event is in the broker already.
type committerPub struct{}

func (committerPub) Publish(context.Context, *core.Event) error { return nil }
func (committerPub) Close() error                               { return nil }
func (committerPub) Sent(context.Context, *core.Event) (bool, error) {
	return true, nil
}

// The wrapper answers core.Committer with the wrapped publisher's word.
func TestCloudEventsForwardsSent(t *testing.T) {
	pub, err := brokers.WithCloudEvents(committerPub{}, brokers.CloudEvents{Source: "/shop"}, brokers.CloudEventsBinding{Prefix: "ce_"})
	if err != nil {
		t.Fatal(err)
	}
	c, ok := pub.(core.Committer)
	if !ok {
		t.Fatal("the wrapper is not a core.Committer")
	}
	if sent, err := c.Sent(context.Background(), &core.Event{Seq: 1}); err != nil || !sent {
		t.Fatalf("Sent = %v, %v; want the wrapped publisher's true", sent, err)
	}
}
