package core

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"sync/atomic"
	"time"
)

// Relay moves events from a Source to a Publisher.
type Relay struct {
	src     Source
	pub     Publisher
	opts    Options
	log     *slog.Logger
	obs     Observer
	pingers []Pinger // the source and publisher, those that can be pinged

	wake chan struct{}
	// halted ends when the relay is asked to stop (requestStop), and
	// stop with it.
	halted      context.Context
	requestStop context.CancelFunc
	stop        <-chan struct{}

	progress atomic.Int64 // unix nanos of the last cycle that reached the source
	// published is when a publish of a claim that hands off last
	// succeeded (unix nanos), which tells one failing event from a broker
	// that takes nothing.
	published atomic.Int64
	startAt   atomic.Int64 // unix nanos of Start; Ready's grace before the first cycle
	// handsOff is set once a claim was a HandOffer: such claims hold
	// nothing open, and the source bounds what it reads, so neither the
	// claims open nor the queued events bound the claiming. A stalled
	// aggregate would otherwise hold every claim open, and the events
	// that show the broker takes others would never be claimed.
	handsOff atomic.Bool
	// share is the share of the source's ordered work this relay claims
	// from (Sharer), as math.Float64bits; 1 until the source says.
	share atomic.Uint64

	// Set up by loop: the queues, a slot per open claim, the open batches
	// and how the recorded ones went.
	sched    *scheduler
	slots    chan struct{}
	open     sync.WaitGroup
	outcomes outcomes

	mu         sync.Mutex
	started    bool
	done       chan struct{}
	cancelWork context.CancelFunc
	// holdErr is why the source's Hold (Holder) ended the relay.
	holdErr error
}

// New returns a relay; it does not start it.
func New(src Source, pub Publisher, opts Options) (*Relay, error) {
	if src == nil {
		return nil, errors.New("new relay: store is nil")
	}
	if pub == nil {
		return nil, errors.New("new relay: publisher is nil")
	}
	o, err := opts.WithDefaults()
	if err != nil {
		return nil, fmt.Errorf("new relay: %w", err)
	}
	if b, ok := pub.(Binder); ok {
		if pub, err = b.Bind(src); err != nil {
			return nil, fmt.Errorf("new relay: bind publisher: %w", err)
		}
	}
	r := &Relay{
		src: src, pub: pub, opts: o, log: o.Logger, obs: o.Observer,
		wake: make(chan struct{}, 1),
	}
	r.halted, r.requestStop = context.WithCancel(context.Background())
	r.stop = r.halted.Done()
	r.share.Store(math.Float64bits(1))
	for _, v := range []any{src, pub} {
		if p, ok := v.(Pinger); ok {
			r.pingers = append(r.pingers, p)
		}
	}
	return r, nil
}

// Run relays until ctx is cancelled, then stops gracefully: the publishes
// in flight finish and are recorded, bounded by Options.ShutdownTimeout.
// A source's Hold (Holder) that ends first stops it too, and Run returns
// Hold's error.
func (r *Relay) Run(ctx context.Context) error {
	if err := r.Start(ctx); err != nil {
		return err
	}
	select {
	case <-ctx.Done():
	case <-r.done:
	}
	sctx, cancel := context.WithTimeout(context.Background(), r.opts.ShutdownTimeout)
	defer cancel()
	return r.Stop(sctx)
}

// Start runs the relay in the background. Cancelling ctx stops it as Stop
// does. A relay starts once.
func (r *Relay) Start(ctx context.Context) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.started {
		return errors.New("start relay: already started")
	}
	r.started = true
	r.startAt.Store(time.Now().UnixNano())
	work, cancel := context.WithCancel(context.WithoutCancel(ctx))
	r.cancelWork = cancel
	r.done = make(chan struct{})
	go func() {
		defer close(r.done)
		r.loop(work)
	}()
	go func() {
		select {
		case <-ctx.Done():
			r.requestStop()
		case <-r.done:
		}
	}()
	return nil
}

// Stop asks the relay to finish the publishes in flight and record them,
// and waits for it; claimed events no lane has started stay pending for
// the next relay. When ctx ends first, in-flight publishes are cancelled
// and left pending, what reached the broker is still recorded, and Stop
// returns ctx's error once the relay has exited. When the source's Hold
// (Holder) ended the relay, Stop returns Hold's error.
func (r *Relay) Stop(ctx context.Context) error {
	r.mu.Lock()
	done, cancel := r.done, r.cancelWork
	r.mu.Unlock()
	if done == nil {
		return nil
	}
	r.requestStop()
	select {
	case <-done:
		cancel()
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.holdErr
	case <-ctx.Done():
		cancel()
		<-done
		return fmt.Errorf("stop relay: %w", ctx.Err())
	}
}

// Options returns the relay's options with defaults filled in.
func (r *Relay) Options() Options { return r.opts }

// Wake makes the relay claim now instead of waiting out its poll interval.
func (r *Relay) Wake() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// LastProgress is when the relay last completed a cycle against the source
// (the zero time if never); readiness checks compare it with the clock.
func (r *Relay) LastProgress() time.Time {
	n := r.progress.Load()
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n)
}

func (r *Relay) stopping() bool {
	select {
	case <-r.stop:
		return true
	default:
		return false
	}
}

// hold runs the source's Hold and waits until it reports held. held is
// false when the relay stops first or Hold returned: a Hold that ends
// before the relay does stops it, with Hold's error. release ends Hold.
func (r *Relay) hold(ctx context.Context, h Holder) (held bool, release func()) {
	hctx, cancel := context.WithCancel(ctx)
	heldc := make(chan struct{})
	var once sync.Once
	ended := make(chan struct{})
	go func() {
		defer close(ended)
		err := h.Hold(hctx, func() { once.Do(func() { close(heldc) }) })
		if hctx.Err() != nil {
			return // the relay ended it
		}
		if err == nil {
			err = errors.New("the source's hold ended")
		}
		r.mu.Lock()
		r.holdErr = err
		r.mu.Unlock()
		r.requestStop()
	}()
	release = func() { cancel(); <-ended }
	select {
	case <-heldc:
		return true, release
	case <-ended:
	case <-r.stop:
	case <-ctx.Done():
	}
	return false, release
}

// loop runs the relay until it stops: the source's hold, wake-ups and
// sharing first, then the lanes and the claim loop; on the way out it
// lets the queued events go and waits for the open batches' records.
func (r *Relay) loop(ctx context.Context) {
	if h, ok := r.src.(Holder); ok {
		held, release := r.hold(ctx, h)
		defer release() // once the last claim is recorded
		if !held {
			return
		}
	}
	if n, ok := r.src.(Notifier); ok && !r.opts.DisableWakeups {
		lctx, cancel := context.WithCancel(ctx)
		listening := make(chan struct{})
		go func() {
			defer close(listening)
			if err := n.Listen(lctx, r.Wake); err != nil && lctx.Err() == nil {
				r.log.Warn("wake-ups stopped; polling only", "error", err)
			}
		}()
		defer func() { cancel(); <-listening }()
	}
	if sh, ok := r.src.(Sharer); ok && !r.opts.Unordered && !r.opts.DisableSharing {
		sctx, cancel := context.WithCancel(ctx)
		sharing := make(chan struct{})
		go func() {
			defer close(sharing)
			if err := sh.Share(sctx, r.setShare); err != nil && sctx.Err() == nil {
				r.log.Warn("sharing stopped; claiming from all of the store's work", "error", err)
			}
			r.setShare(1)
		}()
		defer func() { cancel(); <-sharing }()
	}
	r.sched = newScheduler(!r.opts.Unordered, r.opts.BatchSize, func(b *batch) { go r.complete(ctx, b) }, r.Wake)
	r.slots = make(chan struct{}, r.opts.Claimers)
	var workers sync.WaitGroup
	for range r.opts.Lanes {
		workers.Add(1)
		go func() {
			defer workers.Done()
			r.work(ctx)
		}()
	}
	r.claimLoop(ctx)
	// Stopping: what is being published finishes and is recorded with its
	// claim; events still queued stay pending for the next relay.
	r.sched.letGoAll()
	r.open.Wait()
	r.sched.close()
	workers.Wait()
}
