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

// Options configure a Relay. The zero value is valid: every unset field
// takes the default named in its comment.
type Options struct {
	BatchSize int // events per claim; default 500, at most MaxBatchSize
	// Lanes is how many events are published at once, across the open
	// claims; in ordered mode each aggregate has one at a time. A broker
	// that answers each publish on its own (Kafka, Pub/Sub) goes as fast
	// as the publishes in flight allow, so this is the setting to raise
	// for it. Default 256, at most MaxLanes.
	Lanes int
	// Claimers is how many claims (batches) may be open at once: while one
	// is published, the next is claimed and the last is recorded. Each open
	// claim holds a database transaction and connection until its every
	// event is resolved; claims that hand off (HandOffer) hold none and
	// are not counted. A relay that shares the ordered work with others
	// (Sharer) opens its part of them, at least one, and all of them while
	// a batch has been open for over a second. Default 4, at most
	// MaxClaimers.
	Claimers       int
	PollInterval   time.Duration // wait after a short batch; default 1s (wake-ups usually come first)
	PublishTimeout time.Duration // bound on one publish; default 30s
	// ShutdownTimeout bounds how long Run waits for the publishes in
	// flight after its context is cancelled; default 30s.
	ShutdownTimeout time.Duration
	// Unordered lets events of one aggregate go out in parallel and
	// out of order, for throughput. The default keeps per-aggregate order.
	Unordered bool
	// DisableWakeups ignores the store's Notifier and relies on polling,
	// as behind PgBouncer in transaction pooling mode.
	DisableWakeups bool
	// DisableSharing ignores the store's Sharer in ordered mode: the
	// relay claims from all of the store's work, still disjoint and in
	// order, but in the way of the other replicas. Set it where the
	// store's sharing cannot work, as behind PgBouncer in transaction
	// pooling mode, which does not keep session locks.
	DisableSharing bool
	// RetryBackoff paces retries of an event whose publish failed
	// transiently; default 500ms doubling to 1m.
	RetryBackoff Backoff
	// ErrorBackoff paces the loop after a claim, complete or whole-batch
	// failure (database or broker down); default 100ms doubling to 30s.
	ErrorBackoff Backoff
	// HandOffAfter applies to sources whose claims hand events off (see
	// HandOffer): a transiently failing event is retried in place, holding
	// its aggregate back, and handed off after this many failures if other
	// events were published meanwhile or the publisher answers its ping.
	// A broker that takes nothing is an outage: the event stays in place
	// and reading pauses. Default 8; -1 never hands off.
	HandOffAfter int
	// ProbeInterval is how often the relay pings the store and the
	// publisher (those that implement Pinger) while it backs off after a
	// failure. Once a ping has failed, the first round in which every ping
	// succeeds ends the wait: the outage is over, so the relay resumes at
	// once instead of sleeping out a backoff grown during it. Default
	// 250ms; each ping is bounded by ProbeTimeout (default 2s).
	ProbeInterval time.Duration
	ProbeTimeout  time.Duration
	// StaleAfter is how long the relay may go without completing a cycle
	// before Ready reports it; default 2 x PublishTimeout (a batch whose
	// publishes time out, then its record) plus 3 x PollInterval, and at
	// least 30s.
	StaleAfter time.Duration
	Logger     *slog.Logger // default: discard
	Observer   Observer     // default: none
}

// Upper bounds of the relay's sizes: past them a relay holds more
// connections, goroutines or memory than any gain pays for.
const (
	MaxBatchSize = 10000
	MaxLanes     = 1024
	MaxClaimers  = 64
)

// WithDefaults returns o with every unset field at its default, or an
// error naming the first field out of range. New calls it; a program
// mapping its own configuration onto Options can call it to show the
// effective values.
func (o Options) WithDefaults() (Options, error) {
	// A Backoff is either unset (the default) or has 0 < Min <= Max: with
	// a zero Min every retry would come at once.
	badBackoff := func(b Backoff) bool { return b != (Backoff{}) && (b.Min <= 0 || b.Max < b.Min) }
	err := CheckOptions("relay options",
		OptionCheck{"BatchSize", fmt.Sprintf("0 (the default) to %d", MaxBatchSize), o.BatchSize < 0 || o.BatchSize > MaxBatchSize},
		OptionCheck{"Lanes", fmt.Sprintf("0 (the default) to %d", MaxLanes), o.Lanes < 0 || o.Lanes > MaxLanes},
		OptionCheck{"Claimers", fmt.Sprintf("0 (the default) to %d", MaxClaimers), o.Claimers < 0 || o.Claimers > MaxClaimers},
		OptionCheck{"PollInterval", "not negative", o.PollInterval < 0},
		OptionCheck{"PublishTimeout", "not negative", o.PublishTimeout < 0},
		OptionCheck{"ShutdownTimeout", "not negative", o.ShutdownTimeout < 0},
		OptionCheck{"ProbeInterval", "not negative", o.ProbeInterval < 0},
		OptionCheck{"ProbeTimeout", "not negative", o.ProbeTimeout < 0},
		OptionCheck{"StaleAfter", "not negative", o.StaleAfter < 0},
		OptionCheck{"RetryBackoff", "unset or 0 < Min <= Max", badBackoff(o.RetryBackoff)},
		OptionCheck{"ErrorBackoff", "unset or 0 < Min <= Max", badBackoff(o.ErrorBackoff)},
		OptionCheck{"HandOffAfter", "-1 (never), 0 (the default) or more", o.HandOffAfter < -1},
	)
	if err != nil {
		return o, err
	}
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	defDur := func(v *time.Duration, d time.Duration) {
		if *v == 0 {
			*v = d
		}
	}
	def(&o.BatchSize, 500)
	def(&o.Lanes, 256)
	def(&o.Claimers, 4)
	def(&o.HandOffAfter, 8)
	defDur(&o.PollInterval, time.Second)
	defDur(&o.PublishTimeout, 30*time.Second)
	defDur(&o.ShutdownTimeout, 30*time.Second)
	defDur(&o.ProbeInterval, 250*time.Millisecond)
	defDur(&o.ProbeTimeout, 2*time.Second)
	defDur(&o.StaleAfter, max(2*o.PublishTimeout+3*o.PollInterval, 30*time.Second))
	if o.RetryBackoff == (Backoff{}) {
		o.RetryBackoff = Backoff{Min: 500 * time.Millisecond, Max: time.Minute}
	}
	if o.ErrorBackoff == (Backoff{}) {
		o.ErrorBackoff = Backoff{Min: 100 * time.Millisecond, Max: 30 * time.Second}
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Observer == nil {
		o.Observer = nopObserver{}
	}
	return o, nil
}

// Relay moves events from a Store to a Publisher.
type Relay struct {
	store   Source
	pub     Publisher
	opts    Options
	log     *slog.Logger
	obs     Observer
	pingers []Pinger // the store and publisher, those that can be pinged

	wake     chan struct{}
	stop     chan struct{}
	stopOnce sync.Once
	progress atomic.Int64 // unix nanos of the last cycle that reached the store
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
	// part is the share of the store's ordered work this relay claims
	// from (Sharer), as math.Float64bits; 1 until the store says.
	part atomic.Uint64

	// Set up by loop: the queues, a slot per open claim, the open batches
	// and how the recorded ones went.
	lanes    *lanes
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
func New(store Source, pub Publisher, opts Options) (*Relay, error) {
	if store == nil {
		return nil, errors.New("new relay: store is nil")
	}
	if pub == nil {
		return nil, errors.New("new relay: publisher is nil")
	}
	o, err := opts.WithDefaults()
	if err != nil {
		return nil, fmt.Errorf("new relay: %w", err)
	}
	r := &Relay{
		store: store, pub: pub, opts: o, log: o.Logger, obs: o.Observer,
		wake: make(chan struct{}, 1),
		stop: make(chan struct{}),
	}
	r.part.Store(math.Float64bits(1))
	for _, v := range []any{store, pub} {
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

// LastProgress is when the relay last completed a cycle against the store
// (the zero time if never); readiness checks compare it with the clock.
func (r *Relay) LastProgress() time.Time {
	n := r.progress.Load()
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n)
}

func (r *Relay) requestStop() { r.stopOnce.Do(func() { close(r.stop) }) }

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

func (r *Relay) loop(ctx context.Context) {
	if h, ok := r.store.(Holder); ok {
		held, release := r.hold(ctx, h)
		defer release() // once the last claim is recorded
		if !held {
			return
		}
	}
	if n, ok := r.store.(Notifier); ok && !r.opts.DisableWakeups {
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
	if sh, ok := r.store.(Sharer); ok && !r.opts.Unordered && !r.opts.DisableSharing {
		sctx, cancel := context.WithCancel(ctx)
		sharing := make(chan struct{})
		go func() {
			defer close(sharing)
			if err := sh.Share(sctx, r.setPart); err != nil && sctx.Err() == nil {
				r.log.Warn("sharing stopped; claiming from all of the store's work", "error", err)
			}
			r.setPart(1)
		}()
		defer func() { cancel(); <-sharing }()
	}
	r.lanes = newLanes(!r.opts.Unordered, r.opts.BatchSize, func(b *batch) { go r.complete(ctx, b) }, r.Wake)
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
	r.lanes.letGoAll()
	r.open.Wait()
	r.lanes.close()
	workers.Wait()
}

// claimLoop makes the claims, one at a time, while a claim may be opened
// and the queues are short, and backs off after failures.
func (r *Relay) claimLoop(ctx context.Context) {
	failures := 0
	var out outage
	fail := func(err error) bool {
		failures++
		wait := r.opts.ErrorBackoff.Delay(failures - 1)
		r.log.Error("relay cycle failed", "error", err, "retry_in", wait, "failures", failures)
		return r.backoff(ctx, wait, &out)
	}
	// Producers wake this relay only while it sleeps (Sleeper): it says
	// so when a claim finds nothing, or a few events after one that found
	// none, claims once more for what committed before, stays asleep
	// across wake-ups that bring it nothing (other relays' events) or a
	// trickle's few events, and ends the sleep, in the background, once
	// claims find events less than streamGap apart.
	sleeper, _ := r.store.(Sleeper)
	if _, ok := r.store.(Notifier); !ok || r.opts.DisableWakeups {
		sleeper = nil
	}
	var asleep bool
	// lastFound: when a claim last found events. A claim that finds a few
	// with none found for streamGap before is a trickle's: the relay
	// sleeps (or stays asleep) rather than lingers, for the claim after a
	// linger would most often find nothing and another would follow the
	// sleep.
	var lastFound time.Time
	var awaking sync.WaitGroup
	awake := func() {
		if !asleep {
			return
		}
		asleep = false
		awaking.Go(func() {
			if err := sleeper.Awake(context.WithoutCancel(ctx)); err != nil {
				r.log.Debug("end sleep", "error", err)
			}
		})
	}
	defer func() {
		awake()
		awaking.Wait()
	}()
	for !r.stopping() && ctx.Err() == nil {
		if !r.ready(ctx) {
			return
		}
		// A batch recorded since the last claim tells how the last round
		// went: a failure backs the loop off, a success resets the backoff.
		// A batch that failed before a probe saw the outage end failed in
		// the outage the loop has waited out already: no second wait.
		if ok, at, err := r.outcomes.take(); err != nil && at.After(out.over) {
			<-r.slots
			if !fail(err) {
				return
			}
			continue
		} else if err != nil {
			r.log.Debug("a batch failed before the outage ended", "error", err)
		} else if ok {
			failures, out.down = 0, false
		}
		next, opened, err := r.claimBatch(ctx)
		streaming := false
		if opened {
			now := time.Now()
			streaming = now.Sub(lastFound) < streamGap
			lastFound = now
		}
		if !opened {
			<-r.slots
		}
		if err != nil {
			if !fail(err) {
				return
			}
			continue
		}
		if next == idle && !opened {
			failures, out.down = 0, false // the store answered and had nothing
		}
		wait := r.opts.PollInterval
		switch next {
		case again:
			awake()
			continue
		case truncated:
			wait = min(wait, truncatedPause)
		}
		if sleeper != nil && next == idle && !streaming {
			// Nothing to claim, or a trickle's few events: sleep, or
			// stay asleep across a wake-up that brought this relay
			// nothing (another relay's event) or only those.
			if !asleep {
				awaking.Wait()
				now, err := sleeper.Sleep(ctx)
				if err != nil {
					r.log.Debug("sleep: producers may not wake this relay until the next poll", "error", err)
					if opened {
						wait = min(wait, lingerPoll) // events are arriving
					}
				} else {
					asleep = true
					if now {
						continue // claim what committed without waking anyone
					}
				}
			}
		} else {
			awake()
			if sleeper != nil && next == idle {
				// Events are arriving: claim again shortly rather than
				// ask every producer to wake this relay, which would
				// serialize their commits (see Sleeper).
				wait = min(wait, lingerPoll)
			}
		}
		woken, ok := r.nap(ctx, wait)
		if !ok {
			return
		}
		if !woken {
			// A poll: the sleep is made anew, in case the store lost it.
			awake()
		}
	}
}

// ready waits until a claim may be made: fewer claims are open than
// claimsWanted (it takes a slot for the next one) and fewer than a batch
// of events wait for a lane (see queuedCount), so the next batch arrives
// before the lanes run dry but memory stays bounded. While no claim may
// open it relieves stalled aggregates, however many events are queued, so
// that one slow publish cannot hold every claim open. False means stop.
func (r *Relay) ready(ctx context.Context) bool {
	var tick <-chan time.Time
	for {
		if (r.handsOff.Load() || r.lanes.queuedCount() < r.opts.BatchSize) && len(r.slots) < r.claimsWanted() {
			select {
			case r.slots <- struct{}{}:
				return true
			default:
			}
		}
		r.lanes.relieve(stallAfter)
		if tick == nil {
			t := time.NewTicker(stallAfter / 4)
			defer t.Stop()
			tick = t.C
		}
		select {
		case <-r.lanes.kick:
		case <-tick:
		case <-r.stop:
			return false
		case <-ctx.Done():
			return false
		}
	}
}

// setPart records the share of the store's ordered work this relay claims
// from (Sharer) and claims at once, for what it may have gained.
func (r *Relay) setPart(part float64) {
	r.part.Store(math.Float64bits(min(max(part, 0), 1)))
	r.Wake()
}

// claimsWanted is how many claims may be open now. Each open claim is a
// transaction the database runs beside the others, and ordered claims
// step over the events their relay has in flight, so relays that share
// the work each open their part of Claimers (at least one): replicas add
// publishers, not concurrent transactions. While a batch has been open
// for over stallAfter (a slow publish), the relay opens up to Claimers,
// so that one slow event does not stop its claiming.
func (r *Relay) claimsWanted() int {
	part := math.Float64frombits(r.part.Load())
	if part >= 1 || r.lanes.openOver(stallAfter) {
		return r.opts.Claimers
	}
	return max(1, int(math.Ceil(float64(r.opts.Claimers)*part)))
}

// stallAfter is how long an aggregate's publish may take before the
// events queued behind it, from newer claims, are let go so their claims
// can be recorded; next to it a normal publish is short.
const stallAfter = time.Second

// pace says when the loop should claim next.
type pace int

const (
	idle      pace = iota // caught up: wait for a wake-up or the poll interval
	again                 // a full batch: more is waiting, claim at once
	truncated             // the claim left pending events out (core.Truncated)
)

// lingerPoll is the wait after a claim that found events but not a full
// batch, as did a claim less than streamGap before, for a relay whose
// producers wake it only while it sleeps: short
// next to a commit-to-delivery goal of milliseconds, long enough that a
// relay keeping up with a steady stream claims a handful of events at a
// time.
const lingerPoll = 2 * time.Millisecond

// streamGap is the longest time between two claims that find events for
// the events to count as a stream the relay lingers for, rather than a
// trickle it sleeps through, woken by each producer: over a linger and
// its claim's round trip, under the 10 ms between events at 100/s.
const streamGap = 5 * time.Millisecond

// truncatedPause is the wait after a truncated claim: the store left
// events out because other relays held earlier events of their aggregates
// (or the claim reached its byte limit). Long enough not to spin on their
// locks, short next to a batch's publish time.
const truncatedPause = 20 * time.Millisecond

// sleep waits d; false means stop.
func (r *Relay) sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-r.stop:
		return false
	case <-ctx.Done():
		return false
	}
}

// nap is the claim loop's wait: d, or less when woken, which it reports;
// false for ok means stop.
func (r *Relay) nap(ctx context.Context, d time.Duration) (woken, ok bool) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return false, true
	case <-r.wake:
		return true, true
	case <-r.stop:
		return false, false
	case <-ctx.Done():
		return false, false
	}
}

// outage is what the claim loop's probes have seen.
type outage struct {
	down bool      // a probe failed and none has succeeded since
	over time.Time // when a probe last succeeded after one had failed
}

// backoff waits d after a failed cycle, probing the store and the
// publisher every ProbeInterval. It returns early, true, when a probe
// succeeds after one had failed (o.down carries that across waits, so a
// server that came back between two waits still counts): the failure was
// an outage and it is over (o.over). A failure with every server
// answering gets the whole wait, so a batch that fails for other reasons
// cannot spin. False means stop.
func (r *Relay) backoff(ctx context.Context, d time.Duration, o *outage) bool {
	if len(r.pingers) == 0 {
		return r.sleep(ctx, d)
	}
	t := time.NewTimer(d)
	defer t.Stop()
	tick := time.NewTicker(r.opts.ProbeInterval)
	defer tick.Stop()
	pctx, cancel := context.WithCancel(ctx)
	// The first probe goes at once: a server that is down shows before
	// it can come back unseen.
	result := make(chan error, 1) // nil while no probe is running
	go func() { result <- r.probe(pctx) }()
	defer func() {
		cancel()
		if result != nil {
			<-result // pingers honour ctx; leave no probe running
		}
	}()
	for {
		select {
		case <-t.C:
			return true
		case <-r.stop:
			return false
		case <-ctx.Done():
			return false
		case <-tick.C:
			if result == nil {
				result = make(chan error, 1)
				go func() { result <- r.probe(pctx) }()
			}
		case err := <-result:
			result = nil
			if err != nil {
				if !o.down {
					r.log.Warn("probe failed; resuming as soon as it succeeds", "error", err)
				}
				o.down = true
				continue
			}
			if o.down {
				o.down, o.over = false, time.Now()
				r.log.Info("probe succeeded; resuming")
				return true
			}
		}
	}
}

// probe pings every pinger, each bounded by ProbeTimeout, and returns the
// first error.
func (r *Relay) probe(ctx context.Context) error {
	for _, p := range r.pingers {
		pctx, cancel := context.WithTimeout(ctx, r.opts.ProbeTimeout)
		err := p.Ping(pctx)
		cancel()
		if err != nil && !errors.Is(err, errors.ErrUnsupported) {
			return err
		}
	}
	return nil
}

// claimBatch makes one claim and queues its events. opened reports that a
// batch was opened (it then owns the slot ready took).
func (r *Relay) claimBatch(ctx context.Context) (next pace, opened bool, err error) {
	seq, inFlight, heldBack := r.lanes.startClaim()
	start := time.Now()
	claim, err := r.store.Claim(ctx, ClaimOptions{Limit: r.opts.BatchSize, Unordered: r.opts.Unordered, InFlight: inFlight, HeldBack: heldBack})
	if err != nil {
		r.obs.Errored("claim", err)
		return idle, false, fmt.Errorf("claim batch: %w", err)
	}
	events := claim.Events()
	rejected := rejectedOf(claim)
	r.obs.Claimed(len(events), time.Since(start))
	next = idle
	switch {
	case len(events)+len(rejected) >= r.opts.BatchSize:
		next = again
	case isTruncated(claim) || len(rejected) > 0:
		next = truncated
	}
	if len(events) == 0 && len(rejected) == 0 {
		if err := claim.Release(ctx); err != nil {
			r.obs.Errored("release", err)
			return idle, false, fmt.Errorf("release empty claim: %w", err)
		}
		r.progress.Store(time.Now().UnixNano())
		return next, false, nil
	}
	r.progress.Store(time.Now().UnixNano())
	for _, rej := range rejected {
		r.log.Warn("event held: the row cannot be relayed", "event_seq", rej.Event.Seq, "event_id", rej.Event.ID, "aggregate_id", rej.Event.AggregateID, "error", rej.Err)
	}
	h, _ := claim.(HandOffer)
	b := &batch{seq: seq, opened: start, claim: claim, handOffer: h, events: events, rejected: rejected,
		states: make([]state, len(events)), errs: make([]error, len(events)), remaining: len(events)}
	if h != nil {
		r.handsOff.Store(true)
		<-r.slots // it holds nothing open (see handsOff)
	}
	r.open.Add(1)
	if !r.lanes.add(b) {
		go r.complete(ctx, b) // nothing for the lanes: rejected rows only, or all let go
	}
	return next, true, nil
}

// work is one lane: it publishes queued events until the lanes close.
func (r *Relay) work(ctx context.Context) {
	// Each publish's timeout context hangs off this lane's own, so lanes
	// do not contend for the relay's context to register and remove them.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	pctx := newPublishCtx(ctx, r.opts.PublishTimeout)
	defer pctx.close()
	for {
		it, ok := r.lanes.take()
		if !ok {
			return
		}
		e := &it.b.events[it.i]
		switch {
		case ctx.Err() != nil:
			r.lanes.finish(it, stLeft, nil) // a hard stop: leave it pending
		case it.b.handOffer != nil:
			st, err := r.publishOrHandOff(ctx, pctx, it.b.handOffer, e)
			r.lanes.finish(it, st, err)
		default:
			err := r.publish(ctx, pctx, e)
			// Cancelled by a hard stop: not the event's fault; leave it pending.
			if err != nil && ctx.Err() != nil && errors.Is(err, ctx.Err()) {
				r.lanes.finish(it, stLeft, nil)
			} else if err != nil {
				r.lanes.finish(it, stFailed, err)
			} else {
				r.lanes.finish(it, stPublished, nil)
			}
		}
	}
}

// publish makes one publish attempt under pctx, the lane's context ctx
// bounded by PublishTimeout.
func (r *Relay) publish(ctx context.Context, pctx *publishCtx, e *Event) error {
	start := time.Now()
	pctx.start(start)
	err := r.pub.Publish(pctx, e)
	pctx.stop()
	r.obs.Published(e, time.Since(start), err)
	if err != nil && (ctx.Err() == nil || !errors.Is(err, ctx.Err())) {
		r.log.Warn("publish failed", "event_seq", e.Seq, "event_id", e.ID, "aggregate_id", e.AggregateID,
			"type", e.Type, "attempt", e.Attempts+1, "permanent", IsPermanent(err), "error", err)
	}
	return err
}

// publishOrHandOff resolves e of a claim that cannot offer it again: it
// is published, retried in place through transient failures, or handed
// off (its error, if any, is the failure recorded with it). stLeft means
// the relay stopped first.
func (r *Relay) publishOrHandOff(ctx context.Context, pctx *publishCtx, h HandOffer, e *Event) (state, error) {
	off, ok := retryRecord(ctx, r, "check hand-off", func() (bool, error) { return h.MustHandOff(ctx, e) })
	switch {
	case !ok:
		return stLeft, nil
	case off:
		if _, ok := retryRecord(ctx, r, "hand off event", func() (struct{}, error) { return struct{}{}, h.HandOff(ctx, e, nil) }); !ok {
			return stLeft, nil
		}
		return stHandedOff, nil
	}
	var firstFailure int64
	for attempt := 0; ; attempt++ {
		start := time.Now().UnixNano()
		err := r.publish(ctx, pctx, e)
		if err == nil {
			r.published.Store(time.Now().UnixNano())
			return stPublished, nil
		}
		if ctx.Err() != nil {
			return stLeft, nil
		}
		if firstFailure == 0 {
			firstFailure = start
		}
		f := Failure{Seq: e.Seq, Reason: err.Error()}
		if !IsPermanent(err) {
			e.Attempts++
			delay := r.opts.RetryBackoff.Delay(attempt)
			// Failing alone while others are published, or while the
			// broker answers its ping: this event, not the broker.
			alone := r.opts.HandOffAfter > 0 && attempt+1 >= r.opts.HandOffAfter &&
				(r.published.Load() > firstFailure || r.publisherAnswers(ctx))
			if !alone {
				if !r.sleep(ctx, delay) {
					return stLeft, nil
				}
				continue
			}
			f.RetryAt = time.Now().Add(delay)
		}
		if _, ok := retryRecord(ctx, r, "hand off event", func() (struct{}, error) { return struct{}{}, h.HandOff(ctx, e, &f) }); !ok {
			return stLeft, nil
		}
		return stHandedOff, err
	}
}

// publisherAnswers says whether the publisher, if it can be pinged,
// answers.
func (r *Relay) publisherAnswers(ctx context.Context) bool {
	p, ok := r.pub.(Pinger)
	if !ok {
		return false
	}
	pctx, cancel := context.WithTimeout(ctx, r.opts.ProbeTimeout)
	defer cancel()
	return p.Ping(pctx) == nil
}

// retryRecord calls f until it succeeds, backing off with ErrorBackoff;
// ok is false when the relay stopped first.
func retryRecord[T any](ctx context.Context, r *Relay, what string, f func() (T, error)) (v T, ok bool) {
	for attempt := 0; ; attempt++ {
		v, err := f()
		if err == nil {
			return v, true
		}
		if ctx.Err() != nil {
			return v, false
		}
		wait := r.opts.ErrorBackoff.Delay(attempt)
		r.obs.Errored("record", err)
		r.log.Error(what+" failed", "error", err, "retry_in", wait)
		if !r.sleep(ctx, wait) {
			return v, false
		}
	}
}

// complete records a batch whose every event is resolved, in the batch's
// own claim, and frees its slot.
func (r *Relay) complete(ctx context.Context, b *batch) {
	defer r.open.Done()
	var done []int64
	var failed []Failure
	handedOff := 0 // held or retried by the source: recorded already
	// Set by a transient failure that may be the broker's.
	brokerFailed := false
	now := time.Now()
	for i, st := range b.states {
		switch st {
		case stHandedOff:
			if b.errs[i] != nil {
				handedOff++
			}
		case stPublished:
			done = append(done, b.events[i].Seq)
		case stFailed:
			err := b.errs[i]
			f := Failure{Seq: b.events[i].Seq, Reason: err.Error()}
			if !IsPermanent(err) {
				f.RetryAt = now.Add(r.opts.RetryBackoff.Delay(b.events[i].Attempts))
				brokerFailed = brokerFailed || !IsUndeliverable(err)
			}
			failed = append(failed, f)
		}
	}
	rejections := make([]error, len(b.rejected))
	for i, rej := range b.rejected {
		rejections[i] = Permanent(fmt.Errorf("cannot relay row: %w", rej.Err))
		failed = append(failed, Failure{Seq: rej.Event.Seq, Reason: rejections[i].Error()})
	}
	// A hard stop cancelled ctx; still record what reached the broker, so
	// it is not published again.
	rctx := ctx
	if ctx.Err() != nil {
		var cancel context.CancelFunc
		rctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
	}
	start := time.Now()
	err := b.claim.Complete(rctx, done, failed)
	r.lanes.closeBatch(b)
	if b.handOffer == nil {
		<-r.slots
	}
	defer r.lanes.signal()
	if err != nil {
		r.obs.Errored("complete", err)
		r.outcomes.put(fmt.Errorf("complete batch of %d: %w", len(b.events)+len(b.rejected), err), time.Now())
		return
	}
	r.obs.Completed(len(done), len(failed)+handedOff, time.Since(start))
	// Reported once recorded: a row is held only now, and a batch that
	// failed to complete is claimed again and rejected anew.
	for i, rej := range b.rejected {
		r.obs.Rejected(&rej.Event, rejections[i])
	}
	r.progress.Store(time.Now().UnixNano())
	// Nothing went out and the broker gave transient errors: it is likely
	// down. Back off the loop rather than hammering the broker and the
	// database. Held or undeliverable events alone mean the broker answered.
	if len(done) == 0 && brokerFailed {
		r.outcomes.put(fmt.Errorf("publish batch: all %d attempted events failed, first: %s", len(failed), failed[0].Reason), now)
		return
	}
	r.outcomes.put(nil, now)
}

// outcomes collects how recorded batches went, for the claim loop.
type outcomes struct {
	mu  sync.Mutex
	err error     // the first failure since the last take
	at  time.Time // when the last of those failures happened
	ok  bool      // a batch was recorded without failing since the last take
}

// put records how a batch went; at is when it failed (its last event's
// failure).
func (o *outcomes) put(err error, at time.Time) {
	o.mu.Lock()
	defer o.mu.Unlock()
	switch {
	case err == nil:
		o.ok = true
	case o.err == nil:
		o.err, o.at = err, at
	case at.After(o.at):
		o.at = at
	}
}

// take returns and clears the first failure, when the last failure
// happened, and whether a batch was recorded without one.
func (o *outcomes) take() (ok bool, at time.Time, err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	ok, at, err = o.ok, o.at, o.err
	o.err, o.ok, o.at = nil, false, time.Time{}
	return ok, at, err
}

func rejectedOf(c Claim) []Rejection {
	if r, ok := c.(Rejecter); ok {
		return r.Rejected()
	}
	return nil
}

func isTruncated(c Claim) bool {
	t, ok := c.(Truncated)
	return ok && t.Truncated()
}
