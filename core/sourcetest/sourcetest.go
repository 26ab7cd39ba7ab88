// Package sourcetest is a conformance suite for the ways events reach a
// broker: a relay over a source (the outbox table, ordered or unordered;
// the replication log with its table path), driven end to end as the
// binary runs it. Every source must keep the same promises: every
// committed event is delivered, first deliveries of an aggregate follow
// commit order, a held event holds back only the later events of its
// aggregate until it is retried, a relay killed and restarted loses
// nothing, a stalled broker bounds what the relay reads, and a graceful
// stop records everything the broker took. A source that is a
// core.Settler must also name its units and settle what was recorded,
// and only that. A source's package runs it
// from its tests with a Harness:
//
//	func TestSourceConformance(t *testing.T) { sourcetest.Run(t, myHarness{}) }
package sourcetest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/outboxhq/outbox/core"
)

// Harness creates the source under test.
type Harness interface {
	// Open returns a new, empty outbox for one subtest, cleaned up by t.
	Open(t *testing.T) Instance
}

// Instance is one outbox, its producer side and its relays.
type Instance interface {
	// Write commits events in one transaction, as a producer would. The
	// suite sets ID (a UUID), AggregateID, Type and Payload.
	Write(ctx context.Context, events []core.Event) error
	// Start starts a relay of the source, publishing to pub and reporting
	// to obs. The suite stops or kills every relay it starts.
	Start(t *testing.T, pub core.Publisher, obs core.Observer) Relay
	// Held lists the ids of an aggregate's events held by a permanent
	// failure, as an operator sees them (`outbox events --state held`).
	Held(ctx context.Context, aggregateID string) ([]string, error)
	// Retry releases the held events of an aggregate, as `outbox retry`
	// does.
	Retry(ctx context.Context, aggregateID string) error
	// ReadAhead is how many events a relay may read from the source while
	// the broker takes none: its memory bound.
	ReadAhead() int
	// Ordered says whether the source keeps per-aggregate order.
	Ordered() bool
}

// Relay is one running relay.
type Relay interface {
	// Stop stops it gracefully: the publishes in flight finish and what
	// the broker took is recorded, so no next relay sends it again.
	Stop(ctx context.Context) error
	// Kill stops it as a crash does: its database sessions end first,
	// then it stops without recording anything.
	Kill()
}

// Run runs the suite. Subtests run one after another, each on its own
// outbox.
func Run(t *testing.T, h Harness) {
	tests := []struct {
		name string
		fn   func(t *testing.T, in Instance)
	}{
		{"DeliversInCommitOrder", testOrder},
		{"HeldEventHoldsOnlyLaterEvents", testHold},
		{"KillsLoseNothing", testKills},
		{"StalledBrokerBoundsReading", testBackPressure},
		{"StopRecordsWhatTheBrokerTook", testStop},
		{"SettlerKnowsWhatWasRecorded", testSettler},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) { tc.fn(t, h.Open(t)) })
	}
}

// wait bounds every wait of the suite for deliveries.
const wait = 30 * time.Second

type body struct {
	Agg string `json:"agg"`
	N   int    `json:"n"`
}

// writer numbers each aggregate's events in commit order: the suite
// commits one transaction at a time, so write order is commit order.
type writer struct {
	t    *testing.T
	in   Instance
	mu   sync.Mutex
	next map[string]int
	ids  map[string]body // every committed event
}

func newWriter(t *testing.T, in Instance) *writer {
	return &writer{t: t, in: in, next: map[string]int{}, ids: map[string]body{}}
}

// write commits one transaction of n events of each aggregate in aggs,
// interleaved, and returns their ids.
func (w *writer) write(n int, aggs ...string) []string {
	w.t.Helper()
	w.mu.Lock()
	defer w.mu.Unlock()
	var evs []core.Event
	var bodies []body
	for range n {
		for _, a := range aggs {
			w.next[a]++
			b := body{Agg: a, N: w.next[a]}
			p, _ := json.Marshal(b)
			evs = append(evs, core.Event{ID: uuid.NewString(), AggregateID: a, Type: "sourcetest.event", Payload: p})
			bodies = append(bodies, b)
		}
	}
	if err := w.in.Write(context.Background(), evs); err != nil {
		w.t.Fatalf("write: %v", err)
	}
	ids := make([]string, len(evs))
	for i, e := range evs {
		w.ids[e.ID] = bodies[i]
		ids[i] = e.ID
	}
	return ids
}

func (w *writer) committed() map[string]body {
	w.mu.Lock()
	defer w.mu.Unlock()
	return maps.Clone(w.ids)
}

// broker records what it took, in order, and can fail or stall.
type broker struct {
	mu       sync.Mutex
	took     []core.Event
	fail     map[string]error // by event id
	stalled  chan struct{}    // non-nil: publishes block until it closes
	inFlight int
	maxIn    int
}

func (b *broker) Publish(ctx context.Context, e *core.Event) error {
	b.mu.Lock()
	err, stall := b.fail[e.ID], b.stalled
	b.inFlight++
	b.maxIn = max(b.maxIn, b.inFlight)
	b.mu.Unlock()
	defer func() {
		b.mu.Lock()
		b.inFlight--
		b.mu.Unlock()
	}()
	if stall != nil {
		select {
		case <-stall:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if err != nil {
		return err
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	b.mu.Lock()
	c := *e
	c.Payload = slices.Clone(e.Payload)
	b.took = append(b.took, c)
	b.mu.Unlock()
	return nil
}

func (b *broker) Close() error { return nil }

func (b *broker) events() []core.Event {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.took)
}

func (b *broker) setFail(id string, err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.fail == nil {
		b.fail = map[string]error{}
	}
	if err == nil {
		delete(b.fail, id)
		return
	}
	b.fail[id] = err
}

// counted is an Observer that counts the events read from the source.
type counted struct {
	core.Observer
	mu   sync.Mutex
	read int
}

func (c *counted) Claimed(n int, d time.Duration) {
	c.mu.Lock()
	c.read += n
	c.mu.Unlock()
}

func (c *counted) total() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.read
}

func newCounted() *counted { return &counted{Observer: core.Observers(nil)} }

// waitFor polls cond until it holds or the suite's bound passes.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(wait)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", wait, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// delivered says whether every id is in the record.
func delivered(b *broker, ids []string) bool {
	seen := map[string]bool{}
	for _, e := range b.events() {
		seen[e.ID] = true
	}
	for _, id := range ids {
		if !seen[id] {
			return false
		}
	}
	return true
}

// checkRecord checks the broker's record against what was committed:
// nothing unknown, everything delivered, and, for ordered sources, the
// first deliveries of each aggregate in commit order. It returns the
// number of redeliveries.
func checkRecord(t *testing.T, in Instance, committed map[string]body, record []core.Event) (dups int) {
	t.Helper()
	seen := map[string]bool{}
	last := map[string]int{}
	for _, e := range record {
		b, ok := committed[e.ID]
		if !ok {
			t.Errorf("event %s delivered but never committed", e.ID)
			continue
		}
		if seen[e.ID] {
			dups++
			continue
		}
		seen[e.ID] = true
		if in.Ordered() && b.N < last[b.Agg] {
			t.Errorf("aggregate %s: event %d first delivered after event %d", b.Agg, b.N, last[b.Agg])
		}
		last[b.Agg] = max(last[b.Agg], b.N)
	}
	for id, b := range committed {
		if !seen[id] {
			t.Errorf("aggregate %s: event %d (%s) committed, never delivered", b.Agg, b.N, id)
		}
	}
	return dups
}

func stop(t *testing.T, r Relay) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	if err := r.Stop(ctx); err != nil {
		t.Errorf("stop relay: %v", err)
	}
}

// Many aggregates, interleaved in transactions of many sizes, delivered
// by a broker whose publishes take varying time: each aggregate's events
// go out in commit order.
func testOrder(t *testing.T, in Instance) {
	w := newWriter(t, in)
	b := &broker{}
	r := in.Start(t, &jittery{broker: b}, nil)
	defer stop(t, r)
	aggs := []string{"a", "b", "c", "d", "e", "f", "g", "h"}
	var ids []string
	for i := range 40 {
		ids = append(ids, w.write(1+i%3, aggs[i%len(aggs)], aggs[(i*3+1)%len(aggs)])...)
	}
	waitFor(t, "every event to be delivered", func() bool { return delivered(b, ids) })
	checkRecord(t, in, w.committed(), b.events())
}

// jittery delays each publish a little, differently per event, so that
// lanes finish out of order.
type jittery struct{ *broker }

func (j *jittery) Publish(ctx context.Context, e *core.Event) error {
	d := time.Duration(e.ID[0]%4) * time.Millisecond
	time.Sleep(d)
	return j.broker.Publish(ctx, e)
}

// A permanent failure holds its event. In an ordered source the later
// events of its aggregate wait behind it and the earlier ones and other
// aggregates go out; a retry releases them, the held event first.
func testHold(t *testing.T, in Instance) {
	w := newWriter(t, in)
	b := &broker{}
	early := w.write(2, "x")
	bad := w.write(1, "x")[0]
	b.setFail(bad, core.Permanent(errors.New("refused by the broker")))
	late := w.write(2, "x")
	other := w.write(3, "y")
	r := in.Start(t, b, nil)
	defer stop(t, r)
	waitFor(t, "the earlier events and the other aggregate", func() bool { return delivered(b, append(slices.Clone(early), other...)) })
	if in.Ordered() {
		time.Sleep(time.Second) // time for a wrong delivery to show
		for _, e := range b.events() {
			if e.ID == bad || slices.Contains(late, e.ID) {
				t.Fatalf("event %s of the held aggregate was delivered before the retry", e.ID)
			}
		}
	} else {
		waitFor(t, "the later events (unordered: nothing waits)", func() bool { return delivered(b, late) })
	}
	// An operator sees the held event, and only it, before retrying.
	waitFor(t, "the failed event to be recorded held", func() bool {
		held, err := in.Held(context.Background(), "x")
		if err != nil {
			t.Fatalf("list held events: %v", err)
		}
		return slices.Equal(held, []string{bad})
	})
	b.setFail(bad, nil)
	if err := in.Retry(context.Background(), "x"); err != nil {
		t.Fatalf("retry: %v", err)
	}
	waitFor(t, "the held event and those after it", func() bool { return delivered(b, append([]string{bad}, late...)) })
	checkRecord(t, in, w.committed(), b.events())
}

// A producer writes while relays are killed and restarted: everything
// committed is delivered, first deliveries in commit order.
func testKills(t *testing.T, in Instance) {
	w := newWriter(t, in)
	b := &broker{}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	start := time.Now()
	wg.Go(func() {
		for i := 0; ctx.Err() == nil; i++ {
			w.write(1+i%4, fmt.Sprintf("k%d", i%5), fmt.Sprintf("k%d", (i+2)%5))
			time.Sleep(5 * time.Millisecond)
		}
	})
	const kills = 4
	for range kills {
		r := in.Start(t, b, nil)
		time.Sleep(400 * time.Millisecond)
		r.Kill()
	}
	cancel()
	wg.Wait()
	writing := time.Since(start)
	r := in.Start(t, b, nil)
	defer stop(t, r)
	committed := w.committed()
	ids := make([]string, 0, len(committed))
	for id := range committed {
		ids = append(ids, id)
	}
	waitFor(t, "every committed event to be delivered", func() bool { return delivered(b, ids) })
	dups := checkRecord(t, in, committed, b.events())
	rate := float64(len(committed)) / writing.Seconds()
	t.Logf("%d events written in %s (%.0f/s), %d redelivered over %d kills: %.0f per kill, %.2fs of writes",
		len(committed), writing.Round(time.Millisecond), rate, dups, kills, float64(dups)/kills, float64(dups)/kills/rate)
}

// A broker that takes nothing: the relay reads at most its read-ahead
// from the source and publishes as many at once as it has lanes; once
// the broker answers, everything goes out.
func testBackPressure(t *testing.T, in Instance) {
	w := newWriter(t, in)
	b := &broker{stalled: make(chan struct{})}
	limit := in.ReadAhead()
	var ids []string
	// One aggregate per event, so that lanes never wait for each other;
	// transactions of a quarter of the read-ahead, as a source may count
	// what it read only at a transaction's end.
	for i := 0; len(ids) < 3*limit; i++ {
		aggs := make([]string, max(1, limit/4))
		for j := range aggs {
			aggs[j] = fmt.Sprintf("bp%d-%d", i, j)
		}
		ids = append(ids, w.write(1, aggs...)...)
	}
	obs := newCounted()
	r := in.Start(t, b, obs)
	defer stop(t, r)
	waitFor(t, "the relay to read from the source", func() bool { return obs.total() > 0 })
	time.Sleep(2 * time.Second)
	if n := obs.total(); n > limit {
		t.Errorf("read %d events while the broker took none, over the read-ahead of %d", n, limit)
	}
	close(b.stalled)
	b.mu.Lock()
	b.stalled = nil
	b.mu.Unlock()
	waitFor(t, "every event once the broker answers", func() bool { return delivered(b, ids) })
	checkRecord(t, in, w.committed(), b.events())
}

// A graceful stop, with publishes in flight, records what the broker
// took: the next relay sends none of it again.
func testStop(t *testing.T, in Instance) {
	w := newWriter(t, in)
	first := &broker{}
	var ids []string
	for i := range 20 {
		ids = append(ids, w.write(1, fmt.Sprintf("s%d", i), fmt.Sprintf("s%d", i+20))...)
	}
	r := in.Start(t, &slow{broker: first}, nil)
	waitFor(t, "a first delivery", func() bool { return len(first.events()) > 0 })
	stop(t, r)
	took := map[string]bool{}
	for _, e := range first.events() {
		took[e.ID] = true
	}
	second := &broker{}
	r = in.Start(t, second, nil)
	defer stop(t, r)
	rest := slices.DeleteFunc(slices.Clone(ids), func(id string) bool { return took[id] })
	waitFor(t, "the events the first relay left", func() bool { return delivered(second, rest) })
	again := 0
	for _, e := range second.events() {
		if took[e.ID] {
			again++
		}
	}
	if again > 0 {
		t.Errorf("the next relay sent %d of the %d events the stopped relay's broker took", again, len(took))
	}
	checkRecord(t, in, w.committed(), append(first.events(), second.events()...))
}

// slow takes 100ms per publish, so a stop finds publishes in flight.
type slow struct{ *broker }

func (s *slow) Publish(ctx context.Context, e *core.Event) error {
	select {
	case <-time.After(100 * time.Millisecond):
	case <-ctx.Done():
		return ctx.Err()
	}
	return s.broker.Publish(ctx, e)
}

// settling is a broker that binds to each relay's source, as a publisher
// that records its progress with the broker does (core.Binder), and
// keeps what each source was asked to publish.
type settling struct {
	*broker
	mu    sync.Mutex
	bound []*bound
}

func (s *settling) Bind(src core.Source) (core.Publisher, error) {
	if st, ok := src.(core.Settler); ok {
		st.Units() // such a publisher names what it owns at once
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	b := &bound{broker: s.broker, src: src}
	s.bound = append(s.bound, b)
	return b, nil
}

// settlers are the bound sources that are core.Settlers.
func (s *settling) settlers() []*bound {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*bound
	for _, b := range s.bound {
		if _, ok := b.src.(core.Settler); ok {
			out = append(out, b)
		}
	}
	return out
}

// bound publishes one source's events and keeps those it was asked to
// publish (tried) and those the broker took.
type bound struct {
	*broker
	src   core.Source
	mu    sync.Mutex
	tried []core.Event
	took  []core.Event
}

func (b *bound) Publish(ctx context.Context, e *core.Event) error {
	b.mu.Lock()
	b.tried = append(b.tried, *e)
	b.mu.Unlock()
	if err := b.broker.Publish(ctx, e); err != nil {
		return err
	}
	b.mu.Lock()
	b.took = append(b.took, *e)
	b.mu.Unlock()
	return nil
}

func sentOf(evs []core.Event) []core.Sent {
	out := make([]core.Sent, len(evs))
	for i, e := range evs {
		out[i] = core.Sent{Unit: e.Unit, Seq: e.Seq, ID: e.ID, Replays: e.Replays}
	}
	return out
}

// A source that is a core.Settler names its units, and every event it
// gives has one of them. An event whose publish is still in flight is
// unsettled: it was not recorded, so the source offers it again after a
// kill; every event the broker took is settled once recorded, which
// happens soon after.
func testSettler(t *testing.T, in Instance) {
	w := newWriter(t, in)
	b := &settling{broker: &broker{stalled: make(chan struct{})}}
	var ids []string
	for i := range 10 {
		ids = append(ids, w.write(2, fmt.Sprintf("u%d", i), fmt.Sprintf("u%d", i+10))...)
	}
	r := in.Start(t, b, nil)
	defer stop(t, r)
	waitFor(t, "publishes in flight", func() bool {
		b.broker.mu.Lock()
		defer b.broker.mu.Unlock()
		return b.broker.inFlight > 0
	})
	srcs := b.settlers()
	if len(srcs) == 0 {
		t.Skip("the source is not a core.Settler")
	}
	ctx := context.Background()
	for _, s := range srcs {
		st := s.src.(core.Settler)
		name, n := st.Units()
		if name == "" || n < 1 {
			t.Fatalf("Units() = %q, %d: want a name and at least one unit", name, n)
		}
		s.mu.Lock()
		tried := slices.Clone(s.tried)
		s.mu.Unlock()
		for _, e := range tried {
			if e.Unit < 0 || e.Unit >= n {
				t.Errorf("event %s has unit %d, outside the source's %d", e.ID, e.Unit, n)
			}
		}
		// The broker took none: none of them is recorded.
		got, err := st.Unsettled(ctx, sentOf(tried))
		if err != nil {
			t.Fatalf("Unsettled: %v", err)
		}
		if len(got) != len(tried) {
			t.Errorf("%d of %d events in flight are unsettled; all must be, none was recorded", len(got), len(tried))
		}
	}
	close(b.broker.stalled)
	b.broker.mu.Lock()
	b.broker.stalled = nil
	b.broker.mu.Unlock()
	waitFor(t, "every event once the broker answers", func() bool { return delivered(b.broker, ids) })
	waitFor(t, "every event the broker took to be settled", func() bool {
		for _, s := range b.settlers() {
			s.mu.Lock()
			took := slices.Clone(s.took)
			s.mu.Unlock()
			got, err := s.src.(core.Settler).Unsettled(ctx, sentOf(took))
			if err != nil {
				t.Fatalf("Unsettled: %v", err)
			}
			if len(got) > 0 {
				return false
			}
		}
		return true
	})
	checkRecord(t, in, w.committed(), b.broker.events())
}
