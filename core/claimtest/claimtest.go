// Package claimtest is a conformance suite for core.Source implementations:
// disjoint claims, transactional production, delivery after a crash,
// recorded failures and the per-aggregate gate of ordered mode, with the
// caller's events in flight. A source's package runs it from its own
// tests with a Harness that creates sources:
//
//	func TestConformance(t *testing.T) { claimtest.Run(t, myHarness{}) }
package claimtest

import (
	"context"
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
	// Open returns a new, empty source for one subtest, cleaned up by t.
	Open(t *testing.T) Instance
}

// Instance is one source under test and the producer side of it.
type Instance interface {
	Source() core.Source
	// Produce writes events in one transaction, as a producer would, and
	// commits it or rolls it back. Each event carries an id, an aggregate
	// id (a UUID), a type and a JSON payload; the source assigns seqs.
	Produce(ctx context.Context, events []core.Event, commit bool) error
	// Pending returns the seqs of the events not dispatched, in seq order.
	Pending(ctx context.Context) ([]int64, error)
}

// Crasher is an optional Instance capability: Crash kills the sessions that
// hold open claims, as when a relay's process dies or its connection drops.
type Crasher interface {
	Crash(ctx context.Context, t *testing.T)
}

// Run runs the suite. Subtests run one after another, each on its own source.
func Run(t *testing.T, h Harness) {
	tests := []struct {
		name string
		fn   func(t *testing.T, in Instance)
	}{
		{"RollbackLeavesNoEvent", testRollback},
		{"ClaimsInSeqOrderWithLimit", testSeqOrder},
		{"OpenClaimsAreDisjoint", testOpenClaimsDisjoint},
		{"ConcurrentClaimersOrdered", func(t *testing.T, in Instance) { testConcurrent(t, in, false) }},
		{"ConcurrentClaimersUnordered", func(t *testing.T, in Instance) { testConcurrent(t, in, true) }},
		{"RelayDrainsEveryCommittedEvent", testRelayDrains},
		{"ReleaseRepublishes", testReleaseRepublishes},
		{"CrashRepublishes", testCrashRepublishes},
		{"CompleteLeavesUnlistedPending", testUnlistedStayPending},
		{"RetryAtDelaysClaim", testRetryAt},
		{"ZeroRetryAtHolds", testZeroRetryAtHolds},
		{"OrderedGateOpenClaim", testGateOpenClaim},
		{"OrderedGateInFlight", testGateInFlight},
		{"OrderedGateLockedRowsHideNothing", testGateLockedRowsHideNothing},
		{"OrderedGateHeldEvent", func(t *testing.T, in Instance) { testGateHeld(t, in, time.Time{}) }},
		{"OrderedGateRetryingEvent", func(t *testing.T, in Instance) { testGateHeld(t, in, time.Now().Add(time.Hour)) }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) { tc.fn(t, h.Open(t)) })
	}
}

// Aggregate ids used by the suite; any UUIDs would do.
var (
	aggX = "00000000-0000-4000-8000-00000000000a"
	aggY = "00000000-0000-4000-8000-00000000000b"
	aggZ = "00000000-0000-4000-8000-00000000000c"
)

func newEvent(agg string, n int) core.Event {
	return core.Event{
		ID:          uuid.NewString(),
		AggregateID: agg,
		Type:        "claimtest.event",
		Payload:     fmt.Appendf(nil, `{"n":%d}`, n),
	}
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// produce commits events given as aggregate ids, one event each, and
// returns them with the seqs the source assigned, in the order given.
func produce(ctx context.Context, t *testing.T, in Instance, aggs ...string) []core.Event {
	t.Helper()
	evs := make([]core.Event, len(aggs))
	for i, a := range aggs {
		evs[i] = newEvent(a, i)
	}
	if err := in.Produce(ctx, evs, true); err != nil {
		t.Fatalf("produce: %v", err)
	}
	return assignSeqs(ctx, t, in, evs)
}

// assignSeqs learns the seqs of evs by claiming everything once.
func assignSeqs(ctx context.Context, t *testing.T, in Instance, evs []core.Event) []core.Event {
	t.Helper()
	c := claim(ctx, t, in, 100000, true)
	seqOf := make(map[string]int64)
	for _, e := range c.Events() {
		seqOf[e.ID] = e.Seq
	}
	release(ctx, t, c)
	for i := range evs {
		seq, ok := seqOf[evs[i].ID]
		if !ok {
			t.Fatalf("committed event %s was not claimable", evs[i].ID)
		}
		evs[i].Seq = seq
	}
	return evs
}

func claim(ctx context.Context, t *testing.T, in Instance, limit int, unordered bool) core.Claim {
	t.Helper()
	c, err := in.Source().Claim(ctx, core.ClaimOptions{Limit: limit, Unordered: unordered})
	if err != nil {
		t.Fatalf("claim: %v", err)
	}
	// A test that fails with a claim open must not leave it holding locks
	// the source's cleanup waits for. Ending an ended claim may fail; fine.
	t.Cleanup(func() { _ = c.Release(context.WithoutCancel(ctx)) })
	return c
}

func release(ctx context.Context, t *testing.T, c core.Claim) {
	t.Helper()
	if err := c.Release(ctx); err != nil {
		t.Fatalf("release: %v", err)
	}
}

func complete(ctx context.Context, t *testing.T, c core.Claim, done []int64, failed []core.Failure) {
	t.Helper()
	if err := c.Complete(ctx, done, failed); err != nil {
		t.Fatalf("complete: %v", err)
	}
}

func seqs(evs []core.Event) []int64 {
	out := make([]int64, len(evs))
	for i, e := range evs {
		out[i] = e.Seq
	}
	return out
}

func pending(ctx context.Context, t *testing.T, in Instance) []int64 {
	t.Helper()
	p, err := in.Pending(ctx)
	if err != nil {
		t.Fatalf("pending: %v", err)
	}
	return p
}

func testRollback(t *testing.T, in Instance) {
	ctx := testCtx(t)
	if err := in.Produce(ctx, []core.Event{newEvent(aggX, 1), newEvent(aggY, 2)}, false); err != nil {
		t.Fatalf("produce rolled back: %v", err)
	}
	if p := pending(ctx, t, in); len(p) != 0 {
		t.Fatalf("rolled-back transaction left pending events %v", p)
	}
	c := claim(ctx, t, in, 10, false)
	if n := len(c.Events()); n != 0 {
		t.Fatalf("claimed %d events of a rolled-back transaction", n)
	}
	release(ctx, t, c)

	committed := produce(ctx, t, in, aggX)
	if p := pending(ctx, t, in); !slices.Equal(p, seqs(committed)) {
		t.Fatalf("pending = %v, want only the committed event %v", p, seqs(committed))
	}
}

func testSeqOrder(t *testing.T, in Instance) {
	ctx := testCtx(t)
	evs := produce(ctx, t, in, aggX, aggY, aggX, aggZ, aggY)
	for _, unordered := range []bool{false, true} {
		c := claim(ctx, t, in, 3, unordered)
		got := c.Events()
		if !slices.Equal(seqs(got), seqs(evs[:3])) {
			t.Fatalf("unordered=%v: claimed %v, want the first three %v", unordered, seqs(got), seqs(evs[:3]))
		}
		for i, e := range got {
			w := evs[i]
			if e.ID != w.ID || e.AggregateID != w.AggregateID || e.Type != w.Type || string(e.Payload) != string(w.Payload) {
				t.Fatalf("claimed event %+v does not match produced %+v", e, w)
			}
			if e.Attempts != 0 || e.CreatedAt.IsZero() {
				t.Fatalf("new event: attempts %d, created_at %v", e.Attempts, e.CreatedAt)
			}
		}
		release(ctx, t, c)
	}
}

func testOpenClaimsDisjoint(t *testing.T, in Instance) {
	ctx := testCtx(t)
	aggs := []string{aggX, aggY, aggZ}
	var all []string
	for i := range 30 {
		all = append(all, aggs[i%3])
	}
	produce(ctx, t, in, all...)
	for _, unordered := range []bool{false, true} {
		a := claim(ctx, t, in, 10, unordered)
		b := claim(ctx, t, in, 10, unordered)
		c := claim(ctx, t, in, 100, unordered)
		seen := make(map[int64]string)
		for name, cl := range map[string]core.Claim{"A": a, "B": b, "C": c} {
			for _, e := range cl.Events() {
				if other, dup := seen[e.Seq]; dup {
					t.Fatalf("unordered=%v: event %d is in open claims %s and %s", unordered, e.Seq, other, name)
				}
				seen[e.Seq] = name
			}
		}
		if n := len(a.Events()); n != 10 {
			t.Fatalf("unordered=%v: first claim got %d events, want 10", unordered, n)
		}
		if unordered && len(seen) != 30 {
			t.Fatalf("unordered: three open claims hold %d of 30 events", len(seen))
		}
		for _, cl := range []core.Claim{a, b, c} {
			release(ctx, t, cl)
		}
	}
}

// testConcurrent has many claimers claim and complete at once. Each event
// must be claimed exactly once; in ordered mode an event may be claimed only
// after every earlier event of its aggregate was completed or is in the same
// claim.
func testConcurrent(t *testing.T, in Instance, unordered bool) {
	ctx := testCtx(t)
	const total, workers = 400, 8
	l := &claimLedger{unordered: unordered, earlier: produceMany(ctx, t, in, total),
		claimedBy: make(map[int64]int), completing: make(map[int64]bool)}
	deadline := time.Now().Add(30 * time.Second)
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			for time.Now().Before(deadline) && !l.finished(total) {
				c, err := in.Source().Claim(ctx, core.ClaimOptions{Limit: 7 + w, Unordered: unordered})
				if err != nil {
					errs <- fmt.Errorf("claim: %w", err)
					return
				}
				got := c.Events()
				l.record(got)
				if err := c.Complete(ctx, seqs(got), nil); err != nil {
					errs <- fmt.Errorf("complete: %w", err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	l.check(t, total)
	if p := pending(ctx, t, in); len(p) != 0 {
		t.Fatalf("%d events still pending after all were completed", len(p))
	}
}

// produceMany commits total events over ten aggregates, in several
// transactions so that claims run against a growing table, and returns
// for each event's seq the seqs of the earlier events of its aggregate.
func produceMany(ctx context.Context, t *testing.T, in Instance, total int) map[int64][]int64 {
	aggs := make([]string, 10)
	for i := range aggs {
		aggs[i] = uuid.NewString()
	}
	var evs []core.Event
	for i := range total {
		evs = append(evs, newEvent(aggs[i%len(aggs)], i))
	}
	for i := 0; i < total; i += 50 {
		if err := in.Produce(ctx, evs[i:min(i+50, total)], true); err != nil {
			t.Fatalf("produce: %v", err)
		}
	}
	evs = assignSeqs(ctx, t, in, evs)
	slices.SortFunc(evs, func(a, b core.Event) int { return int(a.Seq - b.Seq) })
	earlier := make(map[int64][]int64)
	lastOf := make(map[string][]int64)
	for _, e := range evs {
		earlier[e.Seq] = slices.Clone(lastOf[e.AggregateID])
		lastOf[e.AggregateID] = append(lastOf[e.AggregateID], e.Seq)
	}
	return earlier
}

// claimLedger records, for testConcurrent, how often each event was
// claimed, and the claims that broke the gate.
type claimLedger struct {
	unordered bool
	earlier   map[int64][]int64 // event seq -> earlier seqs of its aggregate

	mu         sync.Mutex
	claimedBy  map[int64]int // event seq -> claims that returned it
	completing map[int64]bool
	violations []string
}

func (l *claimLedger) finished(total int) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.claimedBy) == total
}

// record counts a claim's events and, in ordered mode, checks each
// against the gate, before the claim is completed.
func (l *claimLedger) record(got []core.Event) {
	l.mu.Lock()
	defer l.mu.Unlock()
	inClaim := make(map[int64]bool, len(got))
	for _, e := range got {
		inClaim[e.Seq] = true
	}
	for _, e := range got {
		l.claimedBy[e.Seq]++
		if l.unordered {
			continue
		}
		for _, prev := range l.earlier[e.Seq] {
			if !inClaim[prev] && !l.completing[prev] {
				l.violations = append(l.violations, fmt.Sprintf("event %d claimed while earlier event %d of its aggregate was neither completed nor in the claim", e.Seq, prev))
			}
		}
	}
	for _, e := range got {
		l.completing[e.Seq] = true
	}
}

// check reports the violations, and the events not claimed exactly once.
func (l *claimLedger) check(t *testing.T, total int) {
	t.Helper()
	for _, v := range l.violations[:min(len(l.violations), 5)] {
		t.Error(v)
	}
	for seq, n := range l.claimedBy {
		if n != 1 {
			t.Errorf("event %d was claimed %d times", seq, n)
		}
	}
	if len(l.claimedBy) != total {
		t.Fatalf("claimed %d distinct events of %d before the deadline", len(l.claimedBy), total)
	}
}

// recorder is a core.Publisher counting publishes by event id.
type recorder struct {
	mu    sync.Mutex
	count map[string]int
}

var _ core.Publisher = (*recorder)(nil)

func newRecorder() *recorder { return &recorder{count: make(map[string]int)} }

func (r *recorder) Publish(ctx context.Context, e *core.Event) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.count[e.ID]++
	return nil
}

func (r *recorder) Close() error { return nil }

func (r *recorder) snapshot() map[string]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return maps.Clone(r.count)
}

// drain runs a relay over the source until nothing is pending.
func drain(ctx context.Context, t *testing.T, in Instance, pub core.Publisher) {
	t.Helper()
	relay, err := core.New(in.Source(), pub, core.Options{
		BatchSize: 25, Lanes: 4, PollInterval: 20 * time.Millisecond, DisableWakeups: true,
	})
	if err != nil {
		t.Fatalf("new relay: %v", err)
	}
	if err := relay.Start(ctx); err != nil {
		t.Fatalf("start relay: %v", err)
	}
	defer func() {
		if err := relay.Stop(ctx); err != nil {
			t.Errorf("stop relay: %v", err)
		}
	}()
	waitFor(t, 30*time.Second, "the relay to drain the outbox", func() bool {
		p, err := in.Pending(ctx)
		return err == nil && len(p) == 0
	})
}

func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func testRelayDrains(t *testing.T, in Instance) {
	ctx := testCtx(t)
	var committed, rolledBack []core.Event
	for tx := range 12 {
		var evs []core.Event
		for i := range 10 {
			evs = append(evs, newEvent([]string{aggX, aggY, aggZ}[(tx+i)%3], i))
		}
		commit := tx%4 != 3
		if err := in.Produce(ctx, evs, commit); err != nil {
			t.Fatalf("produce: %v", err)
		}
		if commit {
			committed = append(committed, evs...)
		} else {
			rolledBack = append(rolledBack, evs...)
		}
	}
	rec := newRecorder()
	drain(ctx, t, in, rec)
	got := rec.snapshot()
	for _, e := range committed {
		if got[e.ID] != 1 {
			t.Errorf("committed event %s published %d times, want 1", e.ID, got[e.ID])
		}
	}
	for _, e := range rolledBack {
		if got[e.ID] != 0 {
			t.Errorf("rolled-back event %s was published", e.ID)
		}
	}
}

// crashAfterPublish claims and "publishes" everything, then ends the claim
// with end instead of completing it; a relay must then publish it all again.
func crashAfterPublish(t *testing.T, in Instance, end func(ctx context.Context, c core.Claim)) {
	ctx := testCtx(t)
	evs := produce(ctx, t, in, aggX, aggY, aggX, aggZ)
	rec := newRecorder()
	c := claim(ctx, t, in, 100, false)
	if len(c.Events()) != len(evs) {
		t.Fatalf("claimed %d events, want %d", len(c.Events()), len(evs))
	}
	for _, e := range c.Events() {
		_ = rec.Publish(ctx, &e)
	}
	end(ctx, c)
	if p := pending(ctx, t, in); !slices.Equal(p, seqs(evs)) {
		t.Fatalf("after the crash pending = %v, want every event %v", p, seqs(evs))
	}
	drain(ctx, t, in, rec)
	got := rec.snapshot()
	for _, e := range evs {
		if got[e.ID] != 2 {
			t.Errorf("event %d published %d times, want 2 (before and after the crash)", e.Seq, got[e.ID])
		}
	}
}

func testReleaseRepublishes(t *testing.T, in Instance) {
	crashAfterPublish(t, in, func(ctx context.Context, c core.Claim) { release(ctx, t, c) })
}

func testCrashRepublishes(t *testing.T, in Instance) {
	cr, ok := in.(Crasher)
	if !ok {
		t.Skip("source has no sessions to kill")
	}
	crashAfterPublish(t, in, func(ctx context.Context, c core.Claim) {
		cr.Crash(ctx, t)
		// The dead relay's claim is gone; recording on it must fail
		// rather than pretend.
		if err := c.Complete(ctx, seqs(c.Events()), nil); err == nil {
			t.Error("complete on a killed session succeeded")
		}
	})
}

func testUnlistedStayPending(t *testing.T, in Instance) {
	ctx := testCtx(t)
	evs := produce(ctx, t, in, aggX, aggY, aggZ)
	c := claim(ctx, t, in, 10, true)
	complete(ctx, t, c, []int64{evs[1].Seq}, nil)
	if p := pending(ctx, t, in); !slices.Equal(p, []int64{evs[0].Seq, evs[2].Seq}) {
		t.Fatalf("pending = %v, want the two unlisted events", p)
	}
	c = claim(ctx, t, in, 10, false)
	if got := seqs(c.Events()); !slices.Equal(got, []int64{evs[0].Seq, evs[2].Seq}) {
		t.Fatalf("reclaimed %v, want the unlisted events", got)
	}
	if c.Events()[0].Attempts != 0 {
		t.Fatalf("an unlisted event counted an attempt")
	}
	release(ctx, t, c)
}

func testRetryAt(t *testing.T, in Instance) {
	ctx := testCtx(t)
	evs := produce(ctx, t, in, aggX, aggY)
	c := claim(ctx, t, in, 10, false)
	retryAt := time.Now().Add(400 * time.Millisecond)
	complete(ctx, t, c, []int64{evs[1].Seq}, []core.Failure{{Seq: evs[0].Seq, Reason: "broker said no", RetryAt: retryAt}})
	if p := pending(ctx, t, in); !slices.Equal(p, []int64{evs[0].Seq}) {
		t.Fatalf("pending = %v, want the failed event", p)
	}
	for _, unordered := range []bool{false, true} {
		c := claim(ctx, t, in, 10, unordered)
		if n := len(c.Events()); n != 0 && time.Now().Before(retryAt) {
			t.Fatalf("unordered=%v: event claimed before its retry time", unordered)
		}
		release(ctx, t, c)
	}
	var got core.Event
	waitFor(t, 10*time.Second, "the failed event to become claimable", func() bool {
		c := claim(ctx, t, in, 10, false)
		defer release(ctx, t, c)
		if len(c.Events()) == 0 {
			return false
		}
		got = c.Events()[0]
		return true
	})
	// The source's clock may differ slightly from ours; allow a little.
	if early := time.Until(retryAt); early > 50*time.Millisecond {
		t.Fatalf("claimed %v before its retry time", early)
	}
	if got.Seq != evs[0].Seq || got.Attempts != 1 {
		t.Fatalf("reclaimed event %d with %d attempts, want event %d with 1", got.Seq, got.Attempts, evs[0].Seq)
	}
}

func testZeroRetryAtHolds(t *testing.T, in Instance) {
	ctx := testCtx(t)
	// held is failed with the zero time, clock with a near retry time: once
	// clock is claimable again, enough time has passed to see held stay put.
	evs := produce(ctx, t, in, aggX, aggY)
	held, clock := evs[0], evs[1]
	c := claim(ctx, t, in, 10, true)
	complete(ctx, t, c, nil, []core.Failure{
		{Seq: held.Seq, Reason: "permanent: too large"},
		{Seq: clock.Seq, Reason: "timeout", RetryAt: time.Now().Add(150 * time.Millisecond)},
	})
	for _, unordered := range []bool{false, true} {
		var got []int64
		waitFor(t, 10*time.Second, "the retrying event to become claimable", func() bool {
			c := claim(ctx, t, in, 10, unordered)
			got = seqs(c.Events())
			release(ctx, t, c)
			return len(got) > 0
		})
		if !slices.Equal(got, []int64{clock.Seq}) {
			t.Fatalf("unordered=%v: claimed %v, want only the retrying event %d; the held one must stay held", unordered, got, clock.Seq)
		}
	}
	if p := pending(ctx, t, in); !slices.Equal(p, []int64{held.Seq, clock.Seq}) {
		t.Fatalf("pending = %v, want both failed events", p)
	}
}

func testGateOpenClaim(t *testing.T, in Instance) {
	ctx := testCtx(t)
	evs := produce(ctx, t, in, aggX, aggX, aggY, aggX, aggZ, aggY)
	a := claim(ctx, t, in, 2, false)
	if got := seqs(a.Events()); !slices.Equal(got, seqs(evs[:2])) {
		t.Fatalf("claim A = %v, want the first two events of X %v", got, seqs(evs[:2]))
	}
	b := claim(ctx, t, in, 100, false)
	want := []int64{evs[2].Seq, evs[4].Seq, evs[5].Seq}
	if got := seqs(b.Events()); !slices.Equal(got, want) {
		t.Fatalf("ordered claim B = %v, want Y and Z only %v: no later event of X while A holds its earlier ones", got, want)
	}
	release(ctx, t, b)

	u := claim(ctx, t, in, 100, true)
	want = []int64{evs[2].Seq, evs[3].Seq, evs[4].Seq, evs[5].Seq}
	if got := seqs(u.Events()); !slices.Equal(got, want) {
		t.Fatalf("unordered claim = %v, want %v: the gate does not apply", got, want)
	}
	release(ctx, t, u)

	// Once A is recorded, the rest of X is free.
	complete(ctx, t, a, seqs(a.Events()), nil)
	b = claim(ctx, t, in, 100, false)
	want = []int64{evs[2].Seq, evs[3].Seq, evs[4].Seq, evs[5].Seq}
	if got := seqs(b.Events()); !slices.Equal(got, want) {
		t.Fatalf("after A completed, claim = %v, want %v", got, want)
	}
	release(ctx, t, b)
}

// testGateLockedRowsHideNothing: the lowest pending events, held by an
// open claim, and the later events of their aggregate, which that claim
// holds back, do not take the room of other aggregates' events in a
// claim: it returns those and, if it can tell, says it left events out.
func testGateLockedRowsHideNothing(t *testing.T, in Instance) {
	ctx := testCtx(t)
	evs := produce(ctx, t, in, aggX, aggX, aggX, aggX, aggY, aggZ)
	a := claim(ctx, t, in, 2, false)
	defer release(ctx, t, a)
	b := claim(ctx, t, in, 2, false)
	defer release(ctx, t, b)
	want := []int64{evs[4].Seq, evs[5].Seq}
	if got := seqs(b.Events()); !slices.Equal(got, want) {
		t.Fatalf("ordered claim of 2 beside an open claim of X's first two = %v, want Y and Z %v", got, want)
	}
	if tr, ok := b.(core.Truncated); ok && !tr.Truncated() {
		t.Fatal("the claim does not report the events of X it held back")
	}
}

// testGateHeld fails the first event of X with retryAt: later X events stay
// back in ordered mode, other aggregates go on.
func testGateHeld(t *testing.T, in Instance, retryAt time.Time) {
	ctx := testCtx(t)
	evs := produce(ctx, t, in, aggX, aggY, aggX, aggZ, aggX)
	c := claim(ctx, t, in, 1, false)
	complete(ctx, t, c, nil, []core.Failure{{Seq: evs[0].Seq, Reason: "rejected", RetryAt: retryAt}})

	c = claim(ctx, t, in, 100, false)
	want := []int64{evs[1].Seq, evs[3].Seq}
	if got := seqs(c.Events()); !slices.Equal(got, want) {
		t.Fatalf("ordered claim = %v, want %v: a failed event of X holds back later X events only", got, want)
	}
	release(ctx, t, c)

	c = claim(ctx, t, in, 100, true)
	want = []int64{evs[1].Seq, evs[2].Seq, evs[3].Seq, evs[4].Seq}
	if got := seqs(c.Events()); !slices.Equal(got, want) {
		t.Fatalf("unordered claim = %v, want %v: the gate does not apply", got, want)
	}
	release(ctx, t, c)
}

// testGateInFlight: events the caller lists as in flight (its own open
// claims) count as part of a new claim for the gate, so the claim takes the
// next events of their aggregate; an earlier event left off the list (its
// publish failed) still holds the aggregate back.
func testGateInFlight(t *testing.T, in Instance) {
	ctx := testCtx(t)
	evs := produce(ctx, t, in, aggX, aggX, aggY, aggX, aggZ, aggX)
	a := claim(ctx, t, in, 2, false)
	if got := seqs(a.Events()); !slices.Equal(got, seqs(evs[:2])) {
		t.Fatalf("claim A = %v, want the first two events of X %v", got, seqs(evs[:2]))
	}
	inFlight := func(req core.ClaimOptions) core.Claim {
		t.Helper()
		c, err := in.Source().Claim(ctx, req)
		if err != nil {
			t.Fatalf("claim with events in flight: %v", err)
		}
		t.Cleanup(func() { _ = c.Release(context.WithoutCancel(ctx)) })
		return c
	}

	b := inFlight(core.ClaimOptions{Limit: 100, InFlight: seqs(a.Events())})
	want := []int64{evs[2].Seq, evs[3].Seq, evs[4].Seq, evs[5].Seq}
	if got := seqs(b.Events()); !slices.Equal(got, want) {
		t.Fatalf("claim B with A's events in flight = %v, want the rest of X with Y and Z %v", got, want)
	}
	release(ctx, t, b)

	// X's second event failed: listed without it, X stays back.
	b = inFlight(core.ClaimOptions{Limit: 100, InFlight: seqs(a.Events()[:1])})
	want = []int64{evs[2].Seq, evs[4].Seq}
	if got := seqs(b.Events()); !slices.Equal(got, want) {
		t.Fatalf("claim B with only X's first event in flight = %v, want Y and Z only %v", got, want)
	}
	release(ctx, t, b)

	// In flight, events stay in their claim: a new claim never returns them.
	b = inFlight(core.ClaimOptions{Limit: 100, Unordered: true, InFlight: seqs(a.Events())})
	for _, id := range seqs(b.Events()) {
		if id == evs[0].Seq || id == evs[1].Seq {
			t.Fatalf("unordered claim with A's events in flight returned A's event %d", id)
		}
	}
	release(ctx, t, b)
	release(ctx, t, a)
}
