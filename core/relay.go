package core

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Options configure a Relay. The zero value is valid: every unset field
// takes the default named in its comment.
type Options struct {
	BatchSize int // events per claim; default 500, at most MaxBatchSize
	Lanes     int // concurrent publishes per batch; default 16, at most MaxLanes
	// Claimers is how many claim loops run side by side, each with its own
	// batch and lanes, as replicas do: one publishes while another waits on
	// the database. Default 2, at most MaxClaimers.
	Claimers       int
	PollInterval   time.Duration // wait after a short batch; default 1s (wake-ups usually come first)
	PublishTimeout time.Duration // bound on one publish; default 30s
	// ShutdownTimeout bounds how long Run waits for the in-flight batch
	// after its context is cancelled; default 30s.
	ShutdownTimeout time.Duration
	// Unordered lets events of one aggregate go out in parallel and
	// out of order, for throughput. The default keeps per-aggregate order.
	Unordered bool
	// DisableWakeups ignores the store's Notifier and relies on polling,
	// as behind PgBouncer in transaction pooling mode.
	DisableWakeups bool
	// RetryBackoff paces retries of an event whose publish failed
	// transiently; default 500ms doubling to 1m.
	RetryBackoff Backoff
	// ErrorBackoff paces the loop after a claim, complete or whole-batch
	// failure (database or broker down); default 100ms doubling to 30s.
	ErrorBackoff Backoff
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
	checks := []struct {
		name, want string
		bad        bool
	}{
		{"BatchSize", fmt.Sprintf("0 (the default) to %d", MaxBatchSize), o.BatchSize < 0 || o.BatchSize > MaxBatchSize},
		{"Lanes", fmt.Sprintf("0 (the default) to %d", MaxLanes), o.Lanes < 0 || o.Lanes > MaxLanes},
		{"Claimers", fmt.Sprintf("0 (the default) to %d", MaxClaimers), o.Claimers < 0 || o.Claimers > MaxClaimers},
		{"PollInterval", "not negative", o.PollInterval < 0},
		{"PublishTimeout", "not negative", o.PublishTimeout < 0},
		{"ShutdownTimeout", "not negative", o.ShutdownTimeout < 0},
		{"ProbeInterval", "not negative", o.ProbeInterval < 0},
		{"ProbeTimeout", "not negative", o.ProbeTimeout < 0},
		{"StaleAfter", "not negative", o.StaleAfter < 0},
		{"RetryBackoff", "unset or 0 < Min <= Max", badBackoff(o.RetryBackoff)},
		{"ErrorBackoff", "unset or 0 < Min <= Max", badBackoff(o.ErrorBackoff)},
	}
	for _, c := range checks {
		if c.bad {
			return o, fmt.Errorf("relay options: %s is invalid, want %s", c.name, c.want)
		}
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
	def(&o.Lanes, 16)
	def(&o.Claimers, 2)
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
	store   Store
	pub     Publisher
	opts    Options
	log     *slog.Logger
	obs     Observer
	pingers []Pinger // the store and publisher, those that can be pinged

	wake     chan struct{}
	stop     chan struct{}
	stopOnce sync.Once
	progress atomic.Int64 // unix nanos of the last cycle that reached the store
	startAt  atomic.Int64 // unix nanos of Start; Ready's grace before the first cycle

	mu         sync.Mutex
	started    bool
	done       chan struct{}
	cancelWork context.CancelFunc
}

// New returns a relay; it does not start it.
func New(store Store, pub Publisher, opts Options) (*Relay, error) {
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
	for _, v := range []any{store, pub} {
		if p, ok := v.(Pinger); ok {
			r.pingers = append(r.pingers, p)
		}
	}
	return r, nil
}

// Run relays until ctx is cancelled, then stops gracefully: the in-flight
// batch is published and recorded, bounded by Options.ShutdownTimeout.
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

// Stop asks the relay to finish its in-flight batch and waits for it. When
// ctx ends first, in-flight publishes are cancelled, their claim released,
// and Stop returns ctx's error once the relay has exited.
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
		return nil
	case <-ctx.Done():
		cancel()
		<-done
		return fmt.Errorf("stop relay: %w", ctx.Err())
	}
}

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

func (r *Relay) loop(ctx context.Context) {
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
	var wg sync.WaitGroup
	for range r.opts.Claimers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.claimLoop(ctx)
		}()
	}
	wg.Wait()
}

func (r *Relay) claimLoop(ctx context.Context) {
	failures := 0
	down := false // a probe failed and none has succeeded since
	for !r.stopping() && ctx.Err() == nil {
		next, err := r.cycle(ctx)
		if err != nil {
			failures++
			wait := r.opts.ErrorBackoff.Delay(failures - 1)
			r.log.Error("relay cycle failed", "error", err, "retry_in", wait, "failures", failures)
			if !r.backoff(ctx, wait, &down) {
				return
			}
			continue
		}
		failures, down = 0, false
		wait := r.opts.PollInterval
		switch next {
		case again:
			if r.opts.Claimers > 1 {
				r.Wake() // a backlog: bring an idle sibling in
			}
			continue
		case truncated:
			wait = min(wait, truncatedPause)
		}
		if !r.sleep(ctx, wait, true) {
			return
		}
	}
}

// pace says when the loop should claim next.
type pace int

const (
	idle      pace = iota // caught up: wait for a wake-up or the poll interval
	again                 // a full batch: more is waiting, claim at once
	truncated             // the claim left pending events out (core.Truncated)
)

// truncatedPause is the wait after a truncated claim: the store left
// events out because other relays held earlier events of their aggregates
// (or the claim reached its byte limit). Long enough not to spin on their
// locks, short next to a batch's publish time.
const truncatedPause = 20 * time.Millisecond

// sleep waits d, or less when woken (if wakeable); false means stop.
func (r *Relay) sleep(ctx context.Context, d time.Duration, wakeable bool) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	var wake <-chan struct{}
	if wakeable {
		wake = r.wake
	}
	select {
	case <-t.C:
	case <-wake:
	case <-r.stop:
		return false
	case <-ctx.Done():
		return false
	}
	return true
}

// backoff waits d after a failed cycle, probing the store and the
// publisher every ProbeInterval. It returns early, true, when a probe
// succeeds after one had failed (*down carries that across waits, so a
// server that came back between two waits still counts): the failure was
// an outage and it is over. A failure with every server answering gets
// the whole wait, so a batch that fails for other reasons cannot spin.
// False means stop.
func (r *Relay) backoff(ctx context.Context, d time.Duration, down *bool) bool {
	if len(r.pingers) == 0 {
		return r.sleep(ctx, d, false)
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
				if !*down {
					r.log.Warn("probe failed; resuming as soon as it succeeds", "error", err)
				}
				*down = true
				continue
			}
			if *down {
				*down = false
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
		if err != nil {
			return err
		}
	}
	return nil
}

// cycle claims, publishes and records one batch, and says when to claim
// next.
func (r *Relay) cycle(ctx context.Context) (next pace, err error) {
	start := time.Now()
	claim, err := r.store.Claim(ctx, ClaimOptions{Limit: r.opts.BatchSize, Unordered: r.opts.Unordered})
	if err != nil {
		r.obs.Errored("claim", err)
		return idle, fmt.Errorf("claim batch: %w", err)
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
			return idle, fmt.Errorf("release empty claim: %w", err)
		}
		r.progress.Store(time.Now().UnixNano())
		return next, nil
	}

	var done []int64
	var failed []Failure
	if len(events) > 0 {
		done, failed = r.publishBatch(ctx, events)
	}
	for _, rej := range rejected {
		err := Permanent(fmt.Errorf("cannot relay row: %w", rej.Err))
		r.obs.Rejected(&rej.Event, err)
		r.log.Warn("event held: the row cannot be relayed", "event_seq", rej.Event.Seq, "event_id", rej.Event.ID, "aggregate_id", rej.Event.AggregateID, "error", rej.Err)
		failed = append(failed, Failure{Seq: rej.Event.Seq, Reason: err.Error()})
	}

	// A hard stop cancelled ctx; still record what reached the broker, so
	// it is not published again.
	rctx := ctx
	if ctx.Err() != nil {
		var cancel context.CancelFunc
		rctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
	}
	start = time.Now()
	if err := claim.Complete(rctx, done, failed); err != nil {
		r.obs.Errored("complete", err)
		return idle, fmt.Errorf("complete batch of %d: %w", len(events)+len(rejected), err)
	}
	r.obs.Completed(len(done), len(failed), time.Since(start))
	r.progress.Store(time.Now().UnixNano())
	// Nothing went out and the broker gave transient errors: it is likely
	// down. Back off the loop rather than hammering the broker and the
	// database. Held events alone (zero RetryAt) mean the broker answered.
	if len(done) == 0 && slices.ContainsFunc(failed, func(f Failure) bool { return !f.RetryAt.IsZero() }) {
		return idle, fmt.Errorf("publish batch: all %d attempted events failed, first: %s", len(failed), failed[0].Reason)
	}
	return next, nil
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

type outcome struct {
	seq  int64
	err  error
	skip bool // not attempted: an earlier event of its aggregate failed
}

// publishBatch publishes events on parallel lanes. In ordered mode an
// aggregate's events share a lane and go out in id order; after one fails,
// the rest of that aggregate in this batch is left pending.
func (r *Relay) publishBatch(ctx context.Context, events []Event) (done []int64, failed []Failure) {
	lanes := r.opts.Lanes
	if lanes > len(events) {
		lanes = len(events)
	}
	perLane := make([][]int, lanes)
	for i := range events {
		var l int
		if r.opts.Unordered {
			l = i % lanes
		} else {
			l = laneOf(events[i].AggregateID, lanes)
		}
		perLane[l] = append(perLane[l], i)
	}
	results := make([]outcome, len(events))
	var wg sync.WaitGroup
	for _, idx := range perLane {
		if len(idx) == 0 {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.runLane(ctx, events, idx, results)
		}()
	}
	wg.Wait()

	now := time.Now()
	for i, res := range results {
		switch {
		case res.skip:
		case res.err == nil:
			done = append(done, res.seq)
		case ctx.Err() != nil && errors.Is(res.err, ctx.Err()):
			// Cancelled by a hard stop: not the event's fault; leave it pending.
		default:
			f := Failure{Seq: res.seq, Reason: res.err.Error()}
			if !IsPermanent(res.err) {
				f.RetryAt = now.Add(r.opts.RetryBackoff.Delay(events[i].Attempts))
			}
			failed = append(failed, f)
		}
	}
	return done, failed
}

func (r *Relay) runLane(ctx context.Context, events []Event, idx []int, results []outcome) {
	var blocked map[string]bool
	for _, i := range idx {
		e := &events[i]
		results[i].seq = e.Seq
		if blocked[e.AggregateID] || ctx.Err() != nil {
			results[i].skip = true
			continue
		}
		start := time.Now()
		pctx, cancel := context.WithTimeout(ctx, r.opts.PublishTimeout)
		err := r.pub.Publish(pctx, e)
		cancel()
		r.obs.Published(e, time.Since(start), err)
		results[i].err = err
		if err == nil {
			continue
		}
		r.log.Warn("publish failed", "event_seq", e.Seq, "event_id", e.ID, "aggregate_id", e.AggregateID,
			"type", e.Type, "attempt", e.Attempts+1, "permanent", IsPermanent(err), "error", err)
		if !r.opts.Unordered {
			if blocked == nil {
				blocked = make(map[string]bool)
			}
			blocked[e.AggregateID] = true
		}
	}
}

// laneOf hashes the aggregate id with FNV-1a, inline so the batch loop
// does not allocate a hasher per event.
func laneOf(aggregateID string, lanes int) int {
	h := uint32(2166136261)
	for i := 0; i < len(aggregateID); i++ {
		h ^= uint32(aggregateID[i])
		h *= 16777619
	}
	return int(h % uint32(lanes))
}
