package wm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// ErrClosed is returned by a publisher after Close.
var ErrClosed = errors.New("publisher is closed")

// errPanicked marks a library call that panicked. Such a link is no use
// any more: it is torn down like a broken one.
var errPanicked = errors.New("broker library panicked")

// contain runs a call into a broker library, turning a panic into an
// error: a library crashing on a lost connection (watermill-amqp closes
// channels it failed to reopen) must not take the relay down.
func contain(what string, fn func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%s: %w: %v", what, errPanicked, r)
		}
	}()
	return fn()
}

// Link is one connection to a broker as an adapter opened it: the Watermill
// publisher over it, and the means to check it and to force it down.
type Link struct {
	Publisher message.Publisher
	// Ping checks the broker over this link. Nil: the link counts as up
	// for as long as it is in use.
	Ping func(ctx context.Context) error
	// Abort closes the link's sockets at once, without a word to the
	// broker, so that calls blocked inside Publisher return even when they
	// ignore every context. It must not block. Nil: nothing to force.
	Abort func()
}

// Dialer opens a new link; ctx bounds the opening. A dialer that cannot
// honour ctx is abandoned when ctx ends: whatever link it returns later is
// torn down at once.
type Dialer func(ctx context.Context) (*Link, error)

// Options configure Open.
type Options struct {
	DialTimeout  time.Duration // bound on opening one link; default 10s
	CloseTimeout time.Duration // bound on Close; default 3s
	// Broken reports the publish and ping errors after which a link is
	// no use (its connection is gone, a pooled channel was lost): it is
	// torn down and the next publish opens a new one. A publish or ping
	// that outlives its deadline always counts as broken.
	Broken func(error) bool
	Logger *slog.Logger // default: discard
}

func (o Options) withDefaults() Options {
	if o.DialTimeout <= 0 {
		o.DialTimeout = 10 * time.Second
	}
	if o.CloseTimeout <= 0 {
		o.CloseTimeout = 3 * time.Second
	}
	if o.Broken == nil {
		o.Broken = func(error) bool { return false }
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return o
}

// guard keeps one live link and replaces it when it wedges. Watermill
// publishers block inside calls that take no context (a pooled channel,
// a confirm, a metadata request): such a call runs aside and is abandoned
// when its deadline passes, the link is marked broken and aborted, and the
// next publish dials a new one. No lock is held across a call into a
// link, so Close never waits behind a blocked publish.
type guard struct {
	dial Dialer
	opts Options
	log  *slog.Logger

	ctx    context.Context // ends pending dials on Close
	cancel context.CancelFunc
	wg     sync.WaitGroup // dials and teardowns running aside

	mu      sync.Mutex
	cur     *link
	opening *opening
	closed  bool
}

// opening is a dial in progress that several callers may wait for.
type opening struct {
	done chan struct{}
	err  error
}

// link counts the calls inside one Link, so a teardown can wait for them
// before it closes the publisher (Watermill publishers do not all survive
// a Close under a running publish).
type link struct {
	Link
	mu       sync.Mutex
	inflight int
	retired  bool
	idle     chan struct{} // closed once retired with nothing in flight
}

func (l *link) enter() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.retired {
		return false
	}
	l.inflight++
	return true
}

func (l *link) exit() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.inflight--
	if l.retired && l.inflight == 0 {
		close(l.idle)
	}
}

// retire stops new calls; it reports false when already retired.
func (l *link) retire() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.retired {
		return false
	}
	l.retired = true
	if l.inflight == 0 {
		close(l.idle)
	}
	return true
}

func (l *link) abort() {
	if l.Abort != nil {
		l.Abort()
	}
}

func newGuard(dial Dialer, opts Options) *guard {
	o := opts.withDefaults()
	ctx, cancel := context.WithCancel(context.Background())
	return &guard{dial: dial, opts: o, log: o.Logger, ctx: ctx, cancel: cancel}
}

// current returns the live link, dialing one when there is none. Only one
// dial runs at a time; callers wait for it until their ctx ends.
func (g *guard) current(ctx context.Context) (*link, error) {
	for {
		g.mu.Lock()
		if g.closed {
			g.mu.Unlock()
			return nil, ErrClosed
		}
		if g.cur != nil {
			l := g.cur
			g.mu.Unlock()
			return l, nil
		}
		o := g.opening
		if o == nil {
			o = &opening{done: make(chan struct{})}
			g.opening = o
			g.wg.Add(1)
			go g.open(o)
		}
		g.mu.Unlock()
		select {
		case <-o.done:
			if o.err != nil {
				return nil, o.err
			}
		case <-ctx.Done():
			return nil, fmt.Errorf("connect: %w", ctx.Err())
		}
	}
}

type dialed struct {
	l   *Link
	err error
}

// open runs one dial, bounded by DialTimeout whether or not the dialer
// honours its context.
func (g *guard) open(o *opening) {
	defer g.wg.Done()
	ctx, cancel := context.WithTimeout(g.ctx, g.opts.DialTimeout)
	defer cancel()
	res := make(chan dialed, 1)
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		var l *Link
		err := contain("connect", func() (err error) { l, err = g.dial(ctx); return err })
		res <- dialed{l, err}
	}()
	var d dialed
	select {
	case d = <-res:
	case <-ctx.Done():
		d.err = fmt.Errorf("connect: no answer within %s: %w", g.opts.DialTimeout, ctx.Err())
		g.wg.Add(1)
		go func() { // the dialer ignored ctx; close what it brings back
			defer g.wg.Done()
			if late := <-res; late.l != nil {
				nl := &link{Link: *late.l, idle: make(chan struct{})}
				nl.retire()
				g.teardown(nl, false, time.Now().Add(g.opts.CloseTimeout))
			}
		}()
	}
	if d.err == nil && d.l == nil {
		d.err = errors.New("connect: dialer returned no link")
	}
	g.mu.Lock()
	g.opening = nil
	if d.err == nil {
		nl := &link{Link: *d.l, idle: make(chan struct{})}
		if g.closed {
			d.err = ErrClosed
			nl.retire()
			g.wg.Add(1)
			go func() {
				defer g.wg.Done()
				g.teardown(nl, true, time.Now().Add(g.opts.CloseTimeout))
			}()
		} else {
			g.cur = nl
		}
	}
	o.err = d.err
	g.mu.Unlock()
	close(o.done)
}

// retire takes l out of use: it is aborted at once, so nothing it still
// holds can reach the broker after a later publish, and closed aside.
func (g *guard) retire(l *link, reason error) {
	g.mu.Lock()
	if g.cur == l {
		g.cur = nil
	}
	g.mu.Unlock()
	if !l.retire() {
		return
	}
	g.log.Warn("broker connection is stuck or lost; tearing it down, the next publish reconnects", "reason", reason)
	l.abort()
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		if err := g.teardown(l, false, time.Now().Add(g.opts.CloseTimeout)); err != nil {
			g.log.Warn("closing a torn-down broker connection", "error", err)
		}
	}()
}

// teardown closes a retired link by deadline. Graceful gives the calls in
// flight until halfway to the deadline to finish before the link is
// aborted; otherwise it was aborted already. The publisher is closed once
// nothing is in flight, so its Close meets no running publish.
func (g *guard) teardown(l *link, graceful bool, deadline time.Time) error {
	wait := func(until time.Time) bool {
		t := time.NewTimer(time.Until(until))
		defer t.Stop()
		select {
		case <-l.idle:
			return true
		case <-t.C:
			return false
		}
	}
	idle := true
	if graceful {
		idle = wait(deadline.Add(-time.Until(deadline) / 2))
	}
	if !idle || !graceful {
		l.abort()
		idle = wait(deadline)
	}
	if !idle {
		// Close it once the calls return, so nothing the library started
		// (Sarama's metadata updater, say) outlives the connection.
		g.wg.Add(1)
		go func() {
			defer g.wg.Done()
			<-l.idle
			_ = contain("close publisher", l.Publisher.Close)
			l.abort()
		}()
		return errors.New("close publisher: calls still blocked after aborting the connection")
	}
	closed := make(chan error, 1)
	go func() { closed <- contain("close publisher", l.Publisher.Close) }()
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case err := <-closed:
		l.abort() // anything Close left open
		if err != nil {
			return fmt.Errorf("close publisher: %w", err)
		}
		return nil
	case <-t.C:
		l.abort()
		// Aborting unblocks the close; it ends aside.
		g.wg.Add(1)
		go func() { defer g.wg.Done(); <-closed }()
		return errors.New("close publisher: timed out")
	}
}

// call runs fn on the live link aside, bounded by ctx. A call that outlives
// its deadline, or fails with a broken-link error, retires the link.
func (g *guard) call(ctx context.Context, fn func(l *link) error) error {
	var l *link
	for {
		var err error
		if l, err = g.current(ctx); err != nil {
			return err
		}
		if l.enter() {
			break
		}
		// Retired between lookup and use: take the next one.
	}
	done := make(chan error, 1)
	go func() {
		defer l.exit()
		done <- fn(l)
	}()
	select {
	case err := <-done:
		if err != nil && (errors.Is(err, errPanicked) || g.opts.Broken(err)) {
			g.retire(l, err)
		}
		return err
	case <-ctx.Done():
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			g.retire(l, errors.New("no answer before the deadline"))
		}
		return ctx.Err()
	}
}

func (g *guard) publish(ctx context.Context, topic string, msg *message.Message) error {
	return g.call(ctx, func(l *link) error {
		return contain("publish", func() error { return l.Publisher.Publish(topic, msg) })
	})
}

func (g *guard) ping(ctx context.Context) error {
	return g.call(ctx, func(l *link) error {
		if l.Ping == nil {
			return nil
		}
		return contain("ping", func() error { return l.Ping(ctx) })
	})
}

// close retires the live link gracefully and waits, by CloseTimeout, for
// every teardown and dial running aside.
func (g *guard) close() error {
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		return nil
	}
	g.closed = true
	l := g.cur
	g.cur = nil
	g.mu.Unlock()
	g.cancel()
	deadline := time.Now().Add(g.opts.CloseTimeout)
	var err error
	if l != nil && l.retire() {
		err = g.teardown(l, true, deadline)
	}
	all := make(chan struct{})
	go func() { g.wg.Wait(); close(all) }()
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case <-all:
	case <-t.C:
		err = errors.Join(err, errors.New("close publisher: earlier connections still closing"))
	}
	return err
}
