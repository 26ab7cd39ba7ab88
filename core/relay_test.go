package core_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/memsource"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// pubFunc is a core.Publisher made of a function.
type pubFunc func(ctx context.Context, e *core.Event) error

func (f pubFunc) Publish(ctx context.Context, e *core.Event) error { return f(ctx, e) }
func (f pubFunc) Close() error                                     { return nil }

// log records successful publishes in order.
type log struct {
	mu  sync.Mutex
	evs []core.Event
}

func (l *log) add(e *core.Event) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.evs = append(l.evs, *e)
}

func (l *log) seqs() []int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]int64, len(l.evs))
	for i, e := range l.evs {
		out[i] = e.Seq
	}
	return out
}

func (l *log) has(seq int64) bool { return slices.Contains(l.seqs(), seq) }

// countingStore counts claims made through it.
type countingStore struct {
	core.Source
	claims atomic.Int64
}

func (s *countingStore) Claim(ctx context.Context, req core.ClaimOptions) (core.Claim, error) {
	s.claims.Add(1)
	return s.Source.Claim(ctx, req)
}

func startRelay(t *testing.T, s core.Source, p core.Publisher, o core.Options) *core.Relay {
	t.Helper()
	r, err := core.New(s, p, o)
	if err != nil {
		t.Fatalf("new relay: %v", err)
	}
	if err := r.Start(context.Background()); err != nil {
		t.Fatalf("start: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := r.Stop(ctx); err != nil {
			t.Errorf("stop: %v", err)
		}
	})
	return r
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

func drained(s *memsource.Source) func() bool { return func() bool { return len(s.Pending()) == 0 } }

func addInterleaved(s *memsource.Source, aggregates, perAggregate int) map[int64]string {
	aggOf := make(map[int64]string)
	for i := range perAggregate {
		for a := range aggregates {
			agg := fmt.Sprintf("agg-%d", a)
			seq := s.Add(core.Event{AggregateID: agg, Type: "t.x", Payload: fmt.Appendf(nil, `{"i":%d}`, i)})[0]
			aggOf[seq] = agg
		}
	}
	return aggOf
}

func TestLanesKeepAggregateOrder(t *testing.T) {
	checkAggregateOrder(t, core.Options{BatchSize: 100, Lanes: 8, PollInterval: time.Millisecond})
}

// Claim loops in one relay share the work as replicas do, and the gate
// keeps each aggregate's events in order between them.
func TestClaimersKeepAggregateOrder(t *testing.T) {
	checkAggregateOrder(t, core.Options{BatchSize: 20, Lanes: 4, Claimers: 4, PollInterval: time.Millisecond})
}

func checkAggregateOrder(t *testing.T, o core.Options) {
	t.Helper()
	s := memsource.New()
	aggOf := addInterleaved(s, 20, 30)
	var (
		published log
		mu        sync.Mutex
		inFlight  = make(map[string]bool)
		lanesBusy int
		maxBusy   int
		overlap   []string
	)
	pub := pubFunc(func(ctx context.Context, e *core.Event) error {
		mu.Lock()
		if inFlight[e.AggregateID] {
			overlap = append(overlap, e.AggregateID)
		}
		inFlight[e.AggregateID] = true
		lanesBusy++
		maxBusy = max(maxBusy, lanesBusy)
		mu.Unlock()
		time.Sleep(time.Duration(rand.N(300)) * time.Microsecond)
		published.add(e)
		mu.Lock()
		inFlight[e.AggregateID] = false
		lanesBusy--
		mu.Unlock()
		return nil
	})
	startRelay(t, s, pub, o)
	waitFor(t, "every event to be published", drained(s))

	last := make(map[string]int64)
	seqs := published.seqs()
	if len(seqs) != len(aggOf) {
		t.Fatalf("published %d events, want %d", len(seqs), len(aggOf))
	}
	for _, seq := range seqs {
		a := aggOf[seq]
		if seq <= last[a] {
			t.Fatalf("aggregate %s: event %d published after %d", a, seq, last[a])
		}
		last[a] = seq
	}
	mu.Lock()
	defer mu.Unlock()
	if len(overlap) > 0 {
		t.Fatalf("two events of one aggregate were published at once: %v", overlap[:min(5, len(overlap))])
	}
	if maxBusy < 2 {
		t.Fatalf("at most %d publish at a time; lanes did not run in parallel", maxBusy)
	}
}

func TestUnorderedPublishesEverything(t *testing.T) {
	s := memsource.New()
	aggOf := addInterleaved(s, 3, 100)
	var published log
	var busy, maxBusy atomic.Int64
	pub := pubFunc(func(ctx context.Context, e *core.Event) error {
		n := busy.Add(1)
		for m := maxBusy.Load(); n > m && !maxBusy.CompareAndSwap(m, n); m = maxBusy.Load() {
		}
		time.Sleep(time.Duration(rand.N(200)) * time.Microsecond)
		busy.Add(-1)
		published.add(e)
		return nil
	})
	startRelay(t, s, pub, core.Options{BatchSize: 50, Lanes: 8, Unordered: true, PollInterval: time.Millisecond})
	waitFor(t, "every event to be published", drained(s))
	got := published.seqs()
	slices.Sort(got)
	if len(got) != len(aggOf) || len(slices.Compact(got)) != len(aggOf) {
		t.Fatalf("published %d events (with duplicates removed %d), want each of %d once", len(published.seqs()), len(got), len(aggOf))
	}
	// Three aggregates, eight lanes: unordered mode spreads one
	// aggregate's events over lanes.
	if maxBusy.Load() <= 3 {
		t.Fatalf("at most %d publishes at a time with 3 aggregates; unordered mode should exceed that", maxBusy.Load())
	}
}

func TestTransientFailureRetriedWithBackoff(t *testing.T) {
	s := memsource.New()
	x := s.Add(
		core.Event{AggregateID: "x"}, core.Event{AggregateID: "y"}, core.Event{AggregateID: "x"},
		core.Event{AggregateID: "y"}, core.Event{AggregateID: "x"},
	)
	failing := x[2] // the second event of x
	var (
		published log
		mu        sync.Mutex
		failedAt  time.Time
		retriedAt time.Time
		attempts  []int
	)
	pub := pubFunc(func(ctx context.Context, e *core.Event) error {
		if e.Seq == failing {
			mu.Lock()
			defer mu.Unlock()
			attempts = append(attempts, e.Attempts)
			if failedAt.IsZero() {
				failedAt = time.Now()
				return errors.New("broker timeout")
			}
			if retriedAt.IsZero() {
				retriedAt = time.Now()
			}
		}
		published.add(e)
		return nil
	})
	backoff := core.Backoff{Min: 200 * time.Millisecond, Max: time.Second}
	startRelay(t, s, pub, core.Options{BatchSize: 10, Lanes: 4, PollInterval: 5 * time.Millisecond, RetryBackoff: backoff})
	// While the failed event waits, the other aggregate goes out and x
	// waits behind it.
	waitFor(t, "the other aggregate to be published", func() bool { return published.has(x[1]) && published.has(x[3]) })
	waitFor(t, "every event to be published", drained(s))

	mu.Lock()
	defer mu.Unlock()
	if wait := retriedAt.Sub(failedAt); wait < backoff.Min/2 {
		t.Fatalf("retried after %v, want at least %v", wait, backoff.Min/2)
	}
	if !slices.Equal(attempts, []int{0, 1}) {
		t.Fatalf("the failing event was published with attempts %v, want [0 1]", attempts)
	}
	var order []int64
	for _, seq := range published.seqs() {
		if seq == x[0] || seq == x[2] || seq == x[4] {
			order = append(order, seq)
		}
	}
	if !slices.Equal(order, []int64{x[0], x[2], x[4]}) {
		t.Fatalf("aggregate x went out as %v, want %v: a later event passed the failed one", order, []int64{x[0], x[2], x[4]})
	}
}

func TestPermanentFailureHoldsOnlyItsAggregate(t *testing.T) {
	s := memsource.New()
	seqs := s.Add(
		core.Event{AggregateID: "x"}, core.Event{AggregateID: "x"}, core.Event{AggregateID: "y"},
		core.Event{AggregateID: "x"}, core.Event{AggregateID: "y"},
	)
	poison := seqs[1]
	var published log
	var reject atomic.Bool
	reject.Store(true)
	pub := pubFunc(func(ctx context.Context, e *core.Event) error {
		if e.Seq == poison && reject.Load() {
			return core.Permanent(errors.New("message too large"))
		}
		published.add(e)
		return nil
	})
	obs := &observer{}
	startRelay(t, s, pub, core.Options{BatchSize: 2, PollInterval: time.Millisecond, Observer: obs})
	waitFor(t, "the poison event to be held", func() bool { return s.Held(poison) })
	waitFor(t, "the other aggregate to be published", func() bool { return published.has(seqs[2]) && published.has(seqs[4]) })
	// Claims go on (the observer sees them) yet x stays held back.
	from := obs.claims.Load()
	waitFor(t, "further claims", func() bool { return obs.claims.Load() > from+3 })
	if published.has(poison) || published.has(seqs[3]) {
		t.Fatalf("published %v; the held event and the x event after it must wait", published.seqs())
	}
	if !strings.Contains(s.LastError(poison), "message too large") {
		t.Fatalf("recorded reason %q", s.LastError(poison))
	}

	// An operator fixes the cause and retries: x continues in order.
	reject.Store(false)
	s.Retry(poison)
	waitFor(t, "every event to be published", drained(s))
	got := published.seqs()
	if i, j := slices.Index(got, poison), slices.Index(got, seqs[3]); i > j {
		t.Fatalf("after the retry x went out as %v", got)
	}
}

// observer counts what the relay reports.
type observer struct {
	claims, published, errored, rejected atomic.Int64
}

func (o *observer) Claimed(int, time.Duration)                  { o.claims.Add(1) }
func (o *observer) Published(*core.Event, time.Duration, error) { o.published.Add(1) }
func (o *observer) Completed(int, int, time.Duration)           {}
func (o *observer) Errored(string, error)                       { o.errored.Add(1) }
func (o *observer) Rejected(*core.Event, error)                 { o.rejected.Add(1) }

func TestBrokerDownBacksOff(t *testing.T) {
	s := memsource.New()
	for range 5 {
		s.Add(core.Event{AggregateID: fmt.Sprint(rand.N(1000))})
	}
	cs := &countingStore{Source: s}
	var up atomic.Bool
	var published log
	pub := pubFunc(func(ctx context.Context, e *core.Event) error {
		if !up.Load() {
			return errors.New("connection refused")
		}
		published.add(e)
		return nil
	})
	// Failed events are claimable again almost at once, so only the loop's
	// own backoff keeps it from spinning.
	startRelay(t, cs, pub, core.Options{
		PollInterval: time.Millisecond, Claimers: 1, // one loop's backoff is counted
		RetryBackoff: core.Backoff{Min: time.Microsecond, Max: time.Microsecond},
		ErrorBackoff: core.Backoff{Min: 20 * time.Millisecond, Max: 100 * time.Millisecond},
	})
	waitFor(t, "the first failed batch", func() bool { return cs.claims.Load() > 0 })
	start, from := time.Now(), cs.claims.Load()
	time.Sleep(time.Second) // the measured window, not a wait for a condition
	n, window := cs.claims.Load()-from, time.Since(start)
	// 20, 40, 80 then 100ms waits: about 12 claims a second. Without a
	// backoff the loop would claim thousands of times.
	if n > 25 {
		t.Fatalf("%d claims in %v while the broker was down: the loop does not back off", n, window)
	}
	if n < 3 {
		t.Fatalf("only %d claims in %v: the loop stopped trying", n, window)
	}
	t.Logf("%d claims in %v with the broker down", n, window)
	up.Store(true)
	waitFor(t, "every event to be published after the broker came back", drained(s))
	if got := len(published.seqs()); got != 5 {
		t.Fatalf("published %d events, want 5", got)
	}
}

func TestStoreDownBacksOff(t *testing.T) {
	s := memsource.New()
	s.SetClaimErr(errors.New("connection refused"))
	cs := &countingStore{Source: s}
	obs := &observer{}
	var published log
	pub := pubFunc(func(ctx context.Context, e *core.Event) error { published.add(e); return nil })
	r := startRelay(t, cs, pub, core.Options{
		PollInterval: time.Millisecond, Observer: obs, Claimers: 1, // one loop's backoff is counted
		ErrorBackoff: core.Backoff{Min: 20 * time.Millisecond, Max: 100 * time.Millisecond},
	})
	waitFor(t, "the first failed claim", func() bool { return cs.claims.Load() > 0 })
	start, from := time.Now(), cs.claims.Load()
	time.Sleep(time.Second) // the measured window
	n, window := cs.claims.Load()-from, time.Since(start)
	if n > 25 || n < 3 {
		t.Fatalf("%d claims in %v with the store down, want a backed-off few", n, window)
	}
	if obs.errored.Load() == 0 {
		t.Fatal("the observer saw no claim errors")
	}
	if !r.LastProgress().IsZero() {
		t.Fatal("LastProgress moved although no claim reached the store")
	}
	t.Logf("%d claims in %v with the store down", n, window)
	seqs := s.Add(core.Event{AggregateID: "a"}, core.Event{AggregateID: "b"})
	s.SetClaimErr(nil)
	waitFor(t, "the events to be published after the store came back", drained(s))
	if got := published.seqs(); !slices.Equal(got, seqs) && !slices.Equal(got, []int64{seqs[1], seqs[0]}) {
		t.Fatalf("published %v, want %v", got, seqs)
	}
	if r.LastProgress().IsZero() {
		t.Fatal("LastProgress not set after successful cycles")
	}
}

func TestStopFinishesInFlightBatch(t *testing.T) {
	s := memsource.New()
	seqs := s.Add(core.Event{AggregateID: "a"}, core.Event{AggregateID: "b"})
	entered := make(chan struct{}, 2)
	release := make(chan struct{})
	var published log
	pub := holding(&published, release, func(*core.Event) bool { entered <- struct{}{}; return true })
	r, err := core.New(s, pub, core.Options{Lanes: 2})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	<-entered
	<-entered
	stopping := make(chan struct{})
	stopped := make(chan error, 1)
	go func() {
		close(stopping)
		stopped <- r.Stop(context.Background())
	}()
	<-stopping
	// Nothing shows that Stop has begun waiting; give it a moment, so the
	// publishes finish during Stop rather than before it.
	time.Sleep(50 * time.Millisecond)
	select {
	case err := <-stopped:
		t.Fatalf("Stop returned (%v) while publishes were in flight", err)
	default:
	}
	close(release)
	if err := <-stopped; err != nil {
		t.Fatalf("graceful stop: %v", err)
	}
	if p := s.Pending(); len(p) != 0 {
		t.Fatalf("after a graceful stop events %v are pending; the in-flight batch must be recorded", p)
	}
	if got := published.seqs(); len(got) != len(seqs) {
		t.Fatalf("published %v, want %v", got, seqs)
	}
}

func TestStopWithExpiredContextCancelsPublishes(t *testing.T) {
	s := memsource.New()
	seqs := s.Add(core.Event{AggregateID: "fast"}, core.Event{AggregateID: "slow"})
	slowEntered := make(chan struct{})
	var cancelled atomic.Bool
	pub := pubFunc(func(ctx context.Context, e *core.Event) error {
		if e.AggregateID == "fast" {
			return nil
		}
		close(slowEntered)
		<-ctx.Done()
		cancelled.Store(true)
		return fmt.Errorf("publish: %w", ctx.Err())
	})
	r, err := core.New(s, pub, core.Options{Lanes: 2, PublishTimeout: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	<-slowEntered
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	err = r.Stop(ctx)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Stop = %v, want the context's deadline error", err)
	}
	if !cancelled.Load() {
		t.Fatal("Stop returned before the in-flight publish saw its context cancelled")
	}
	// What reached the broker is recorded; the cancelled event stays
	// pending as it was, with no failure counted against it.
	if p := s.Pending(); !slices.Equal(p, []int64{seqs[1]}) {
		t.Fatalf("pending = %v, want only the cancelled event %d", p, seqs[1])
	}
	if s.LastError(seqs[1]) != "" || s.Held(seqs[1]) {
		t.Fatalf("the cancelled event was recorded as failed: %q", s.LastError(seqs[1]))
	}
}

func TestRunReturnsOnCancel(t *testing.T) {
	s := memsource.New()
	var published log
	pub := pubFunc(func(ctx context.Context, e *core.Event) error { published.add(e); return nil })
	r, err := core.New(s, pub, core.Options{PollInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	seq := s.Add(core.Event{AggregateID: "a"})[0]
	r.Wake()
	waitFor(t, "the event to be published", func() bool { return published.has(seq) })
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run = %v, want nil after cancel", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Run did not return after its context was cancelled")
	}
	if err := r.Start(context.Background()); err == nil {
		t.Fatal("a relay started twice")
	}
}

func TestWakeShortensPoll(t *testing.T) {
	s := memsource.New()
	var published log
	pub := pubFunc(func(ctx context.Context, e *core.Event) error { published.add(e); return nil })
	obs := &observer{}
	r := startRelay(t, s, pub, core.Options{PollInterval: time.Hour, Observer: obs})
	waitFor(t, "the first (empty) claim", func() bool { return obs.claims.Load() > 0 })
	seq := s.Add(core.Event{AggregateID: "a"})[0]
	start := time.Now()
	r.Wake()
	waitFor(t, "the woken relay to publish", func() bool { return published.has(seq) })
	t.Logf("wake to publish: %v", time.Since(start))
}

func TestStopBeforeStart(t *testing.T) {
	r, err := core.New(memsource.New(), pubFunc(func(context.Context, *core.Event) error { return nil }), core.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Stop(context.Background()); err != nil {
		t.Fatalf("Stop before Start = %v", err)
	}
}

func TestOptionsValidation(t *testing.T) {
	s := memsource.New()
	pub := pubFunc(func(context.Context, *core.Event) error { return nil })
	for _, tc := range []struct {
		field string
		opts  core.Options
	}{
		{"BatchSize", core.Options{BatchSize: -1}},
		{"Lanes", core.Options{Lanes: -2}},
		{"BatchSize", core.Options{BatchSize: core.MaxBatchSize + 1}},
		{"Lanes", core.Options{Lanes: core.MaxLanes + 1}},
		{"Claimers", core.Options{Claimers: core.MaxClaimers + 1}},
		{"PollInterval", core.Options{PollInterval: -time.Second}},
		{"PublishTimeout", core.Options{PublishTimeout: -1}},
		{"ShutdownTimeout", core.Options{ShutdownTimeout: -1}},
		{"RetryBackoff", core.Options{RetryBackoff: core.Backoff{Min: time.Second, Max: time.Millisecond}}},
		{"RetryBackoff", core.Options{RetryBackoff: core.Backoff{Min: -1, Max: time.Second}}},
		{"RetryBackoff", core.Options{RetryBackoff: core.Backoff{Max: time.Second}}},
		{"ErrorBackoff", core.Options{ErrorBackoff: core.Backoff{Min: time.Second}}},
	} {
		_, err := core.New(s, pub, tc.opts)
		if err == nil || !strings.Contains(err.Error(), tc.field) {
			t.Errorf("options %+v: error %v, want one naming %s", tc.opts, err, tc.field)
		}
	}
	if _, err := core.New(nil, pub, core.Options{}); err == nil || !strings.Contains(err.Error(), "store") {
		t.Errorf("nil store: %v", err)
	}
	if _, err := core.New(s, nil, core.Options{}); err == nil || !strings.Contains(err.Error(), "publisher") {
		t.Errorf("nil publisher: %v", err)
	}
	if _, err := core.New(s, pub, core.Options{}); err != nil {
		t.Errorf("zero options: %v", err)
	}
}

func TestBackoffDelay(t *testing.T) {
	b := core.Backoff{Min: 100 * time.Millisecond, Max: time.Second}
	for attempt, want := range []time.Duration{100, 200, 400, 800, 1000, 1000} {
		want *= time.Millisecond
		for range 50 {
			if d := b.Delay(attempt); d < want/2 || d > want {
				t.Fatalf("Delay(%d) = %v, want within [%v, %v]", attempt, d, want/2, want)
			}
		}
	}
	huge := core.Backoff{Min: time.Nanosecond, Max: 1<<63 - 1}
	for _, attempt := range []int{62, 63, 64, 100, 1 << 20} {
		if d := huge.Delay(attempt); d < 0 {
			t.Fatalf("Delay(%d) = %v, negative", attempt, d)
		}
	}
}

// A batch whose only events the broker rejected for good shows that the
// broker is up: the loop must not back off as if it were down.
func TestPermanentRejectionIsNotBrokerDown(t *testing.T) {
	s := memsource.New()
	poison := s.Add(core.Event{AggregateID: "x", Type: "too.large"})[0]
	var published log
	pub := pubFunc(func(ctx context.Context, e *core.Event) error {
		if e.Type == "too.large" {
			return core.Permanent(errors.New("message too large"))
		}
		published.add(e)
		return nil
	})
	r := startRelay(t, s, pub, core.Options{
		PollInterval: time.Hour,
		ErrorBackoff: core.Backoff{Min: time.Hour, Max: time.Hour},
	})
	waitFor(t, "the poison event to be held", func() bool { return s.Held(poison) })
	seq := s.Add(core.Event{AggregateID: "y", Type: "fine"})[0]
	r.Wake()
	waitFor(t, "the next event to be published", func() bool { return published.has(seq) })
}

// Options reports the effective values, defaults filled in, so that code
// built around a relay (a readiness check, a log line) reads them once.
func TestOptionsHaveDefaults(t *testing.T) {
	r, err := core.New(memsource.New(), pubFunc(func(context.Context, *core.Event) error { return nil }), core.Options{Lanes: 3})
	if err != nil {
		t.Fatal(err)
	}
	want, err := core.Options{Lanes: 3}.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	if got := r.Options(); got.Lanes != 3 || got.BatchSize != want.BatchSize || got.StaleAfter != want.StaleAfter || got.Logger == nil {
		t.Errorf("Options() = %+v, want the defaults filled in around Lanes 3", got)
	}
}

// The relay bounds each publish by PublishTimeout on its lane's one
// context: a publish that hangs is cut with the deadline's error, and the
// lane's next publish, the retry, gets a live context.
func TestRelayCutsAHungPublishAndRetriesIt(t *testing.T) {
	s := memsource.New()
	seqs := s.Add(core.Event{AggregateID: "a"}, core.Event{AggregateID: "a"})
	var (
		mu   sync.Mutex
		cut  []error
		sent log
	)
	pub := pubFunc(func(ctx context.Context, e *core.Event) error {
		mu.Lock()
		first := len(cut) == 0
		mu.Unlock()
		if first {
			<-ctx.Done() // a broker that never answers
			mu.Lock()
			cut = append(cut, ctx.Err())
			mu.Unlock()
			return ctx.Err()
		}
		if err := ctx.Err(); err != nil {
			return err // a context left done: the events stay pending
		}
		sent.add(e)
		return nil
	})
	startRelay(t, s, pub, core.Options{Lanes: 1, PublishTimeout: 50 * time.Millisecond, PollInterval: 5 * time.Millisecond,
		RetryBackoff: core.Backoff{Min: time.Millisecond, Max: time.Millisecond}})
	waitFor(t, "both events to be published after the hung publish", drained(s))
	mu.Lock()
	defer mu.Unlock()
	if len(cut) != 1 || !errors.Is(cut[0], context.DeadlineExceeded) {
		t.Fatalf("the hung publish saw %v, want the deadline's error", cut)
	}
	if got := sent.seqs(); !slices.Equal(got, seqs) {
		t.Fatalf("published %v, want %v in order after the retry", got, seqs)
	}
}
