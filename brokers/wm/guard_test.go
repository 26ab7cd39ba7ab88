package wm_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.uber.org/goleak"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/wm"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/memsource"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// conn is a fake broker connection. While its broker is frozen a publish
// blocks, ignoring every context, until the connection is aborted, as
// Watermill's pooled AMQP channels do.
type conn struct {
	b       *broker
	id      int
	aborted chan struct{}
	once    sync.Once
	closed  atomic.Bool
}

func (c *conn) Publish(topic string, msgs ...*message.Message) error {
	if c.b.panics.Load() {
		panic("publish on a channel the library failed to reopen")
	}
	if c.closed.Load() {
		return errors.New("publish on a closed publisher")
	}
	if c.b.frozen.Load() {
		<-c.aborted
		return errors.New("connection reset")
	}
	if c.b.dropped.Load() {
		return errDropped
	}
	c.b.published.Add(1)
	return nil
}

func (c *conn) Close() error {
	// Watermill publishers do not survive a Close under a running
	// publish; the guard must never do that.
	c.closed.Store(true)
	if c.b.panics.Load() {
		panic("close of a channel the library failed to reopen")
	}
	return nil
}

func (c *conn) abort() { c.once.Do(func() { close(c.aborted) }) }

var errDropped = errors.New("connection dropped")

// broker hands out conns and can freeze, drop, or hang its dials.
type broker struct {
	mu        sync.Mutex
	conns     []*conn
	frozen    atomic.Bool // publishes block until aborted
	dropped   atomic.Bool // publishes fail with errDropped
	hangDial  atomic.Bool // dials ignore ctx and block until released
	panics    atomic.Bool // Publish and Close panic, as a library's nil channel does
	release   chan struct{}
	published atomic.Int64
}

func newBroker() *broker { return &broker{release: make(chan struct{})} }

func (b *broker) dial(ctx context.Context) (*wm.Link, error) {
	if b.hangDial.Load() {
		<-b.release
	} else if b.frozen.Load() {
		<-ctx.Done() // an honest dialer: gives up with its context
		return nil, ctx.Err()
	}
	b.mu.Lock()
	c := &conn{b: b, id: len(b.conns), aborted: make(chan struct{})}
	b.conns = append(b.conns, c)
	b.mu.Unlock()
	return &wm.Link{
		Publisher: c,
		Abort:     c.abort,
		Ping: func(ctx context.Context) error {
			if b.frozen.Load() {
				select {
				case <-ctx.Done():
					return ctx.Err()
				case <-c.aborted:
					return errors.New("connection reset")
				}
			}
			if b.dropped.Load() {
				return errDropped
			}
			return nil
		},
	}, nil
}

func (b *broker) dials() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.conns)
}

func (b *broker) conn(i int) *conn {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.conns[i]
}

func open(t *testing.T, b *broker, o wm.Options) *wm.Publisher {
	t.Helper()
	if o.Broken == nil {
		o.Broken = func(err error) bool { return errors.Is(err, errDropped) }
	}
	p, err := wm.Open(t.Context(), b.dial, &brokers.Routing{Fixed: "t"}, nil, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

var ev = &core.Event{Seq: 1, ID: "u1", AggregateID: "a", Type: "t.x", Payload: []byte(`{}`)}

func publish(p *wm.Publisher, d time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	return p.Publish(ctx, ev)
}

// A publish stuck in a call that ignores its context returns by its
// deadline; the connection is aborted and the next publish dials anew.
func TestStuckPublishReturnsAndRebuilds(t *testing.T) {
	b := newBroker()
	p := open(t, b, wm.Options{})
	b.frozen.Store(true)
	start := time.Now()
	err := publish(p, 100*time.Millisecond)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("publish to a frozen broker: %v, want the deadline", err)
	}
	if d := time.Since(start); d > 300*time.Millisecond {
		t.Fatalf("publish returned after %v with a 100ms deadline", d)
	}
	select {
	case <-b.conn(0).aborted:
	case <-time.After(time.Second):
		t.Fatal("the wedged connection was not aborted")
	}
	b.frozen.Store(false)
	if err := publish(p, time.Second); err != nil {
		t.Fatalf("publish after the broker thawed: %v", err)
	}
	if n := b.dials(); n != 2 {
		t.Fatalf("%d dials, want 2: the wedged connection must be replaced", n)
	}
	waitFor(t, "the wedged publisher to be closed", b.conn(0).closed.Load)
}

// A broken-link error (a dropped connection) replaces the link at once.
func TestBrokenErrorRebuilds(t *testing.T) {
	b := newBroker()
	p := open(t, b, wm.Options{})
	b.dropped.Store(true)
	if err := publish(p, time.Second); !errors.Is(err, errDropped) {
		t.Fatalf("publish on a dropped connection: %v", err)
	}
	b.dropped.Store(false)
	if err := publish(p, time.Second); err != nil {
		t.Fatal(err)
	}
	if n := b.dials(); n != 2 {
		t.Fatalf("%d dials, want 2", n)
	}
}

// A library that panics inside Publish or Close (watermill-amqp closing a
// channel it failed to reopen) costs a link, not the process.
func TestLibraryPanicIsContained(t *testing.T) {
	b := newBroker()
	p := open(t, b, wm.Options{})
	b.panics.Store(true)
	if err := publish(p, time.Second); err == nil || !strings.Contains(err.Error(), "panicked") {
		t.Fatalf("publish into a panicking library: %v, want an error naming the panic", err)
	}
	waitFor(t, "the panicking link's close to run", b.conn(0).closed.Load)
	b.panics.Store(false)
	if err := publish(p, time.Second); err != nil {
		t.Fatalf("publish after the panic: %v", err)
	}
	if n := b.dials(); n != 2 {
		t.Fatalf("%d dials, want 2: the panicking link must be replaced", n)
	}
	b.panics.Store(true)
	if err := p.Close(); err == nil || !strings.Contains(err.Error(), "panicked") {
		t.Fatalf("close of a panicking library: %v, want an error naming the panic", err)
	}
}

// Close returns promptly while a publish is stuck: it aborts the
// connection instead of waiting on it.
func TestCloseWhilePublishStuck(t *testing.T) {
	b := newBroker()
	p, err := wm.Open(t.Context(), b.dial, &brokers.Routing{Fixed: "t"}, nil, wm.Options{CloseTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	b.frozen.Store(true)
	published := make(chan error, 1)
	go func() { published <- p.Publish(context.Background(), ev) }() // no deadline at all
	time.Sleep(50 * time.Millisecond)
	start := time.Now()
	if err := p.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	if d := time.Since(start); d > 1200*time.Millisecond {
		t.Fatalf("Close took %v with a 1s bound", d)
	}
	select {
	case err := <-published:
		if err == nil {
			t.Fatal("the stuck publish succeeded")
		}
	case <-time.After(time.Second):
		t.Fatal("the stuck publish did not return after Close")
	}
	if !b.conn(0).closed.Load() {
		t.Fatal("the publisher was not closed")
	}
	if err := publish(p, time.Second); !errors.Is(err, wm.ErrClosed) {
		t.Fatalf("publish after Close: %v, want ErrClosed", err)
	}
	if err := p.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

// A dialer that ignores its context cannot hold Open past DialTimeout; the
// link it returns late is closed.
func TestOpenBoundedByDialTimeout(t *testing.T) {
	b := newBroker()
	b.hangDial.Store(true)
	start := time.Now()
	_, err := wm.Open(t.Context(), b.dial, nil, nil, wm.Options{DialTimeout: 200 * time.Millisecond, CloseTimeout: 100 * time.Millisecond})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Open against a dial that never answers: %v, want a deadline error", err)
	}
	if d := time.Since(start); d > time.Second {
		t.Fatalf("Open took %v with a 200ms dial timeout", d)
	}
	close(b.release)
	waitFor(t, "the late link to be closed", func() bool { return b.dials() == 1 && b.conn(0).closed.Load() })
}

// Ping answers over the live link, and dials one when the last was torn
// down; a ping past its deadline retires the link.
func TestPing(t *testing.T) {
	b := newBroker()
	p := open(t, b, wm.Options{DialTimeout: 100 * time.Millisecond})
	var _ core.Pinger = p
	if err := p.Ping(t.Context()); err != nil {
		t.Fatalf("ping: %v", err)
	}
	b.frozen.Store(true)
	ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
	defer cancel()
	if err := p.Ping(ctx); err == nil {
		t.Fatal("ping of a frozen broker succeeded")
	}
	if err := p.Ping(t.Context()); err == nil { // dials, which times out
		t.Fatal("ping with no link and a frozen broker succeeded")
	}
	b.frozen.Store(false)
	if err := p.Ping(t.Context()); err != nil {
		t.Fatalf("ping after the thaw: %v", err)
	}
	if n := b.dials(); n != 2 {
		t.Fatalf("%d dials, want 2", n)
	}
}

// The relay over a guarded publisher: the broker freezes mid-backlog, its
// publishes wedge, and within 2s of the thaw the relay is publishing again
// on a new connection, however long its error backoff had grown.
func TestRelayResumesAfterFreeze(t *testing.T) {
	b := newBroker()
	p := open(t, b, wm.Options{DialTimeout: 200 * time.Millisecond, CloseTimeout: time.Second})
	s := memsource.New()
	for i := range 200 {
		s.Add(core.Event{AggregateID: string(rune('a' + i%20)), Type: "t.x", ID: "u"})
	}
	b.frozen.Store(true)
	r, err := core.New(s, p, core.Options{
		Lanes: 4, BatchSize: 50, PollInterval: 10 * time.Millisecond,
		PublishTimeout: 200 * time.Millisecond, ShutdownTimeout: time.Second,
		RetryBackoff: core.Backoff{Min: time.Millisecond, Max: time.Millisecond},
		ErrorBackoff: core.Backoff{Min: 10 * time.Second, Max: 30 * time.Second},
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- r.Run(ctx) }()
	time.Sleep(2 * time.Second) // a failed batch, and a failed probe after it
	if b.published.Load() != 0 {
		t.Fatal("published while frozen")
	}
	thaw := time.Now()
	b.frozen.Store(false)
	waitFor(t, "a publish after the thaw", func() bool { return b.published.Load() > 0 })
	if d := time.Since(thaw); d > 2*time.Second {
		t.Fatalf("first publish %v after the thaw, want within 2s", d)
	}
	t.Logf("publishing again %v after the thaw (%d dials)", time.Since(thaw).Round(time.Millisecond), b.dials())
	waitFor(t, "the backlog to drain", func() bool { return len(s.Pending()) == 0 })
	cancel()
	if err := <-ran; err != nil {
		t.Fatal(err)
	}
}

// Stopping the relay while publishes are wedged: Run returns within its
// shutdown timeout and Close right after, the batch released.
func TestShutdownWhileWedged(t *testing.T) {
	b := newBroker()
	p, err := wm.Open(t.Context(), b.dial, &brokers.Routing{Fixed: "t"}, nil, wm.Options{CloseTimeout: 500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	s := memsource.New()
	for range 20 {
		s.Add(core.Event{AggregateID: "a", Type: "t.x"})
	}
	b.frozen.Store(true)
	r, err := core.New(s, p, core.Options{Lanes: 2, PublishTimeout: time.Hour, ShutdownTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- r.Run(ctx) }()
	time.Sleep(100 * time.Millisecond)
	start := time.Now()
	cancel()
	if err := <-ran; !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Run = %v, want the shutdown deadline", err)
	}
	if err := p.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	if d := time.Since(start); d > 1200*time.Millisecond {
		t.Fatalf("stop and close took %v, want within shutdown 300ms + close 500ms and a margin", d)
	}
	if n := len(s.Pending()); n != 20 {
		t.Fatalf("%d events pending after the stop, want all 20 left for the next relay", n)
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}
