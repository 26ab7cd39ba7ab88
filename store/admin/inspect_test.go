package admin_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
	"github.com/outboxhq/outbox/store/admin"
)

func infoIDs(list []admin.EventInfo) []int64 {
	ids := make([]int64, len(list))
	for i, e := range list {
		ids[i] = e.Seq
	}
	return ids
}

func (f *poisonFixture) events(q admin.EventsOptions) []int64 {
	f.t.Helper()
	list, err := f.st.Events(f.ctx, q)
	if err != nil {
		f.t.Fatalf("Events(%+v): %v", q, err)
	}
	for _, e := range list {
		// Held and retrying events are pending too.
		undispatched := e.State() != admin.StateDispatched && e.State() != admin.StateParked
		if ok := e.State() == q.State || (q.State == admin.StatePending || q.State == admin.StateStuck) && undispatched; !ok {
			f.t.Errorf("Events(%s) listed event %d in state %s", q.State, e.Seq, e.State())
		}
	}
	return infoIDs(list)
}

// fail records failures through a claim, as the relay does: reasons for
// permanent failures, retryIn > 0 for transient ones.
func (f *poisonFixture) fail(retryIn time.Duration, reasons map[int64]string) {
	f.t.Helper()
	c, _ := f.claim(1000)
	var failed []core.Failure
	for _, e := range c.Events() {
		if r, ok := reasons[e.Seq]; ok {
			fl := core.Failure{Seq: e.Seq, Reason: r}
			if retryIn > 0 {
				fl.RetryAt = time.Now().Add(retryIn)
			}
			failed = append(failed, fl)
		}
	}
	if len(failed) != len(reasons) {
		f.t.Fatalf("claimed %d of the %d events to fail", len(failed), len(reasons))
	}
	if err := c.Complete(f.ctx, nil, failed); err != nil {
		f.t.Fatal(err)
	}
}

func TestEventsByStateAndFilter(t *testing.T) {
	f := newPoisonFixture(t)
	a, b, c := uuid.NewString(), uuid.NewString(), uuid.NewString()
	aIDs := f.write(a, "order.placed", "order.paid", "order.shipped")
	bIDs := f.write(b, "invoice.sent")
	cIDs := f.write(c, "order.placed", "order.paid")
	f.fail(0, map[int64]string{aIDs[0]: "permanent: topic \"orders\" not found"})
	f.fail(time.Hour, map[int64]string{bIDs[0]: "broker timeout after 30s"})
	// c's first goes out, its second is parked.
	cl, _ := f.claim(1000)
	if err := cl.Complete(f.ctx, []int64{cIDs[0]}, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := f.st.Park(f.ctx, admin.Selector{Seqs: []int64{cIDs[1]}}, "bad data"); err != nil {
		t.Fatal(err)
	}

	cases := []struct {
		q    admin.EventsOptions
		want []int64
	}{
		{admin.EventsOptions{State: admin.StatePending}, []int64{aIDs[0], aIDs[1], aIDs[2], bIDs[0]}},
		{admin.EventsOptions{State: admin.StateHeld}, []int64{aIDs[0]}},
		{admin.EventsOptions{State: admin.StateRetrying}, []int64{bIDs[0]}},
		{admin.EventsOptions{State: admin.StateParked}, []int64{cIDs[1]}},
		{admin.EventsOptions{State: admin.StateDispatched}, []int64{cIDs[0]}},
		// Held events are stuck at any age; the others only when old.
		{admin.EventsOptions{State: admin.StateStuck}, []int64{aIDs[0]}},
		{admin.EventsOptions{State: admin.StatePending, Type: "order.paid"}, []int64{aIDs[1]}},
		{admin.EventsOptions{State: admin.StatePending, AggregateID: b}, []int64{bIDs[0]}},
		{admin.EventsOptions{State: admin.StatePending, Error: "TIMEOUT"}, []int64{bIDs[0]}},
		{admin.EventsOptions{State: admin.StatePending, After: aIDs[1]}, []int64{aIDs[2], bIDs[0]}},
		{admin.EventsOptions{State: admin.StatePending, Limit: 2}, []int64{aIDs[0], aIDs[1]}},
		{admin.EventsOptions{State: admin.StatePending, CreatedAfter: time.Now().Add(time.Hour)}, nil},
		{admin.EventsOptions{State: admin.StatePending, CreatedBefore: time.Now().Add(time.Hour)}, []int64{aIDs[0], aIDs[1], aIDs[2], bIDs[0]}},
	}
	for _, c := range cases {
		if got := f.events(c.q); !slices.Equal(got, c.want) {
			t.Errorf("Events(%+v) = %v, want %v", c.q, got, c.want)
		}
	}
	// Old pending events are stuck too.
	if _, err := f.pool.Exec(f.ctx, `UPDATE `+f.table()+` SET created_at = now() - interval '1 hour' WHERE seq = $1`, aIDs[2]); err != nil {
		t.Fatal(err)
	}
	if got := f.events(admin.EventsOptions{State: admin.StateStuck, StuckAfter: time.Minute}); !slices.Equal(got, []int64{aIDs[0], aIDs[2]}) {
		t.Errorf("stuck after an hour-old event: %v, want %v", got, []int64{aIDs[0], aIDs[2]})
	}

	list, err := f.st.Events(f.ctx, admin.EventsOptions{State: admin.StatePending, AggregateID: a})
	if err != nil {
		t.Fatal(err)
	}
	held, waiting := list[0], list[2]
	if !held.Held || held.HeldBack != 2 || held.Attempts != 1 || held.FailedAt.IsZero() || !strings.Contains(held.LastError, "orders") {
		t.Errorf("held event: %+v", held)
	}
	if waiting.WaitsFor != aIDs[0] || waiting.Held {
		t.Errorf("the aggregate's third event waits for %d, want %d (the held one)", waiting.WaitsFor, aIDs[0])
	}

	for _, q := range []admin.EventsOptions{
		{State: "lost"}, {State: admin.StatePending, Limit: admin.MaxEventsLimit + 1},
		{State: admin.StatePending, AggregateID: strings.Repeat("k", event.MaxKeyBytes+1)}, {State: admin.StatePending, After: -1},
		{State: admin.StatePending, CreatedAfter: time.Now(), CreatedBefore: time.Now().Add(-time.Hour)},
	} {
		if _, err := f.st.Events(f.ctx, q); err == nil {
			t.Errorf("Events(%+v) accepted a bad query", q)
		}
	}
}

func TestEventDetailWithNeighbours(t *testing.T) {
	f := newPoisonFixture(t)
	agg := uuid.NewString()
	ids := f.write(agg, "a.one", "a.two", "a.three", "a.four")
	other := f.write(uuid.NewString(), "b.one")
	if _, err := f.pool.Exec(f.ctx, `UPDATE `+f.table()+` SET headers = '{"k":"v"}', dispatched_at = now() WHERE seq = $1`, ids[0]); err != nil {
		t.Fatal(err)
	}
	d, err := f.st.Event(f.ctx, ids[1], "")
	if err != nil {
		t.Fatal(err)
	}
	if d.Seq != ids[1] || d.Type != "a.two" || string(d.Payload) != `{"t":"a.two"}` || d.Headers != nil {
		t.Errorf("detail = %+v, payload %s", d.EventInfo, d.Payload)
	}
	if got := infoIDs(d.Before); !slices.Equal(got, ids[:1]) {
		t.Errorf("before = %v, want %v", got, ids[:1])
	}
	if got := infoIDs(d.After); !slices.Equal(got, ids[2:]) {
		t.Errorf("after = %v, want %v (and not the other aggregate's %v)", got, ids[2:], other)
	}
	if d.HeldBack != 2 || d.After[0].WaitsFor != ids[1] {
		t.Errorf("held back %d, next waits for %d; want 2 and %d", d.HeldBack, d.After[0].WaitsFor, ids[1])
	}
	byID, err := f.st.Event(f.ctx, 0, d.ID)
	if err != nil || byID.Seq != d.Seq {
		t.Errorf("by event id %s: %d, %v", d.ID, byID.Seq, err)
	}
	first, err := f.st.Event(f.ctx, ids[0], "")
	if err != nil || string(first.Headers) != `{"k": "v"}` || first.State() != admin.StateDispatched {
		t.Errorf("first: headers %s, state %s, %v", first.Headers, first.State(), err)
	}
	if _, err := f.st.Event(f.ctx, 1<<40, ""); err == nil || !strings.Contains(err.Error(), admin.ErrEventNotFound.Error()) {
		t.Errorf("missing id: %v, want ErrEventNotFound", err)
	}
	if _, err := f.st.Event(f.ctx, 0, uuid.NewString()); err == nil {
		t.Error("missing event id: no error")
	}
	if _, err := f.st.Event(f.ctx, 0, "x"); err == nil {
		t.Error("bad event id: no error")
	}
}

// A pending neighbour far away is still found; dispatched ones beyond the
// window are not looked for.
func TestEventNeighboursWindow(t *testing.T) {
	f := newPoisonFixture(t)
	agg := uuid.NewString()
	first := f.write(agg, "a.one")
	if _, err := f.pool.Exec(f.ctx, `SELECT setval(pg_get_serial_sequence($1, 'seq'), $2)`, f.table(), first[0]+admin.NeighbourWindow+10); err != nil {
		t.Fatal(err)
	}
	second := f.write(agg, "a.two")
	third := f.write(agg, "a.three")
	d, err := f.st.Event(f.ctx, second[0], "")
	if err != nil {
		t.Fatal(err)
	}
	if got := infoIDs(d.Before); !slices.Equal(got, first) || d.WaitsFor != first[0] {
		t.Errorf("before = %v, waits for %d; want the pending %v far away", got, d.WaitsFor, first)
	}
	if _, err := f.pool.Exec(f.ctx, `UPDATE `+f.table()+` SET dispatched_at = now() WHERE seq = $1`, first[0]); err != nil {
		t.Fatal(err)
	}
	d, err = f.st.Event(f.ctx, second[0], "")
	if err != nil {
		t.Fatal(err)
	}
	if len(d.Before) != 0 || !slices.Equal(infoIDs(d.After), third) {
		t.Errorf("before = %v, after = %v; want none beyond the window, and %v", infoIDs(d.Before), infoIDs(d.After), third)
	}
}

func TestFailuresGroupedByFingerprint(t *testing.T) {
	f := newPoisonFixture(t)
	var notFound, timeouts []int64
	reasons := map[int64]string{}
	for i := range 3 {
		id := f.write(uuid.NewString(), "order.placed")[0]
		notFound = append(notFound, id)
		reasons[id] = fmt.Sprintf("permanent: event %d: topic \"orders-%d\" not found", id, i)
	}
	f.fail(0, reasons)
	reasons = map[int64]string{}
	for range 2 {
		id := f.write(uuid.NewString(), "invoice.sent")[0]
		timeouts = append(timeouts, id)
		reasons[id] = fmt.Sprintf("dial tcp 10.0.0.%d:9092: i/o timeout after 30s", id)
	}
	f.fail(time.Hour, reasons)
	if _, err := f.st.Park(f.ctx, admin.Selector{Seqs: notFound[2:]}, "given up"); err != nil {
		t.Fatal(err)
	}

	groups, err := f.st.Failures(f.ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(groups) != 2 {
		t.Fatalf("groups = %+v, want 2", groups)
	}
	nf, to := groups[0], groups[1]
	if nf.Events != 3 || nf.Held != 2 || nf.Parked != 1 || nf.Retrying != 0 || !slices.Equal(nf.Types, []string{"order.placed"}) {
		t.Errorf("not-found group = %+v", nf)
	}
	if want := `permanent: event <n>: topic "…" not found`; nf.Fingerprint != want {
		t.Errorf("fingerprint %q, want %q", nf.Fingerprint, want)
	}
	if to.Events != 2 || to.Retrying != 2 || to.Held != 0 || !strings.Contains(to.Example, "i/o timeout") {
		t.Errorf("timeout group = %+v", to)
	}
	if nf.FirstSeen.IsZero() || nf.LastSeen.Before(nf.FirstSeen) || time.Since(nf.LastSeen) > time.Minute {
		t.Errorf("first/last seen %v %v", nf.FirstSeen, nf.LastSeen)
	}
	if !contains(notFound, nf.ExampleSeq) {
		t.Errorf("example %d is not one of %v", nf.ExampleSeq, notFound)
	}
	// The fingerprint selects the group's events again.
	got := f.events(admin.EventsOptions{State: admin.StateHeld, Fingerprint: nf.Fingerprint})
	if !slices.Equal(got, notFound[:2]) {
		t.Errorf("held events of the group: %v, want %v", got, notFound[:2])
	}
	// And so does a selector, for acting on the whole group.
	bySel := admin.Selector{Fingerprint: nf.Fingerprint}
	if a, err := f.st.Affected(f.ctx, admin.ActionUnpark, bySel); err != nil || a.Count != 1 {
		t.Errorf("unpark by fingerprint would touch %+v (%v), want the parked one", a, err)
	}
	if n, err := f.st.Retry(f.ctx, bySel); err != nil || n != 2 {
		t.Errorf("retry by fingerprint released %d (%v), want the 2 held", n, err)
	}
	if !strings.Contains(bySel.String(), "error like") {
		t.Errorf("selector reads %q", bySel)
	}
	// A replay clears what a failure recorded.
	if _, err := f.pool.Exec(f.ctx, `UPDATE `+f.table()+` SET dispatched_at = now(), retry_at = NULL WHERE seq = $1`, timeouts[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := f.st.Replay(f.ctx, admin.Selector{Seqs: timeouts[:1]}, admin.ReplayOptions{}); err != nil {
		t.Fatal(err)
	}
	d, err := f.st.Event(f.ctx, timeouts[0], "")
	if err != nil || !d.FailedAt.IsZero() || d.LastError != "" || d.Attempts != 0 {
		t.Errorf("replayed event keeps its failure: %+v, %v", d.EventInfo, err)
	}
}

func TestActivityPerMinute(t *testing.T) {
	pool, cfg, st := opsStore(t)
	opsInsert(t, pool, cfg,
		opsRow{dispatchedAgo: time.Second}, opsRow{dispatchedAgo: 2 * time.Second},
		opsRow{dispatchedAgo: 3 * time.Minute}, opsRow{dispatchedAgo: 2 * time.Hour})
	if _, err := pool.Exec(context.Background(), `UPDATE `+`"`+cfg.Schema+`".events_outbox SET failed_at = now() - interval '10 minutes' WHERE seq = (SELECT min(seq) FROM "`+cfg.Schema+`".events_outbox)`); err != nil {
		t.Fatal(err)
	}
	mins, err := st.Activity(context.Background(), 60)
	if err != nil {
		t.Fatal(err)
	}
	if len(mins) != 60 {
		t.Fatalf("%d minutes, want 60", len(mins))
	}
	var dispatched, failed int64
	for i, m := range mins {
		if i > 0 && m.Start.Sub(mins[i-1].Start) != time.Minute {
			t.Fatalf("minute %d starts at %v, after %v", i, m.Start, mins[i-1].Start)
		}
		dispatched += m.Dispatched
		failed += m.Failed
	}
	// The two events of the last seconds may straddle a minute boundary.
	if last := mins[59].Dispatched + mins[58].Dispatched; last < 2 || dispatched != 3 || failed != 1 {
		t.Errorf("dispatched %d (last two minutes %d), failed %d; want 3 (2), 1", dispatched, last, failed)
	}
	for _, n := range []int{0, admin.MaxActivityMinutes + 1} {
		if _, err := st.Activity(context.Background(), n); err == nil {
			t.Errorf("Activity(%d): no error", n)
		}
	}
}

func TestAffectedCountsWhatTheActionTouches(t *testing.T) {
	f := newPoisonFixture(t)
	agg := uuid.NewString()
	ids := f.write(agg, "a.one", "a.two", "a.three")
	f.fail(0, map[int64]string{ids[0]: "permanent: no route"})
	sel := admin.Selector{AggregateID: agg}
	count := func(a admin.Action) int64 {
		t.Helper()
		n, err := f.st.Affected(f.ctx, a, sel)
		if err != nil {
			t.Fatal(err)
		}
		if n.More {
			t.Errorf("%s: More for 3 events", a)
		}
		return n.Count
	}
	if r, p, u, rp := count(admin.ActionRetry), count(admin.ActionPark), count(admin.ActionUnpark), count(admin.ActionReplay); r != 1 || p != 3 || u != 0 || rp != 0 {
		t.Errorf("retry %d, park %d, unpark %d, replay %d; want 1, 3, 0, 0", r, p, u, rp)
	}
	// The count is what the action then does.
	want := count(admin.ActionRetry)
	if n, err := f.st.Retry(f.ctx, sel); err != nil || n != want {
		t.Errorf("retry touched %d (%v), counted %d", n, err, want)
	}
	want = count(admin.ActionPark)
	if n, err := f.st.Park(f.ctx, sel, "r"); err != nil || n != want {
		t.Errorf("park touched %d (%v), counted %d", n, err, want)
	}
	if n := count(admin.ActionUnpark); n != 3 {
		t.Errorf("unpark would touch %d, want 3", n)
	}
	if _, err := f.st.Affected(f.ctx, "delete", sel); err == nil {
		t.Error("unknown action: no error")
	}
	if _, err := f.st.Affected(f.ctx, admin.ActionRetry, admin.Selector{}); err == nil {
		t.Error("empty selector: no error")
	}
}

// An event waiting for its deliver-at time is listed as scheduled, not as
// retrying or stuck, however old its row.
func TestEventsScheduledApart(t *testing.T) {
	f := newPoisonFixture(t)
	var seq int64
	if err := f.pool.QueryRow(f.ctx, `INSERT INTO `+f.table()+` (aggregate_id, type, payload, deliver_at, created_at)
VALUES ('k-1', 'reminder.due', '{}', now() + interval '1 day', now() - interval '2 hours') RETURNING seq`).Scan(&seq); err != nil {
		t.Fatal(err)
	}
	if got := f.events(admin.EventsOptions{State: admin.StateScheduled}); !slices.Equal(got, []int64{seq}) {
		t.Errorf("scheduled = %v, want [%d]", got, seq)
	}
	for _, st := range []admin.EventState{admin.StateRetrying, admin.StateStuck, admin.StateHeld} {
		if got := f.events(admin.EventsOptions{State: st, StuckAfter: time.Minute}); len(got) != 0 {
			t.Errorf("%s lists the scheduled event: %v", st, got)
		}
	}
	list, err := f.st.Events(f.ctx, admin.EventsOptions{State: admin.StatePending})
	if err != nil || len(list) != 1 {
		t.Fatalf("pending = %v, %v", list, err)
	}
	if e := list[0]; e.State() != admin.StateScheduled || e.DeliverAt.Before(time.Now().Add(23*time.Hour)) || !e.RetryAt.IsZero() {
		t.Errorf("scheduled event: state %s, deliver at %v, retry at %v", e.State(), e.DeliverAt, e.RetryAt)
	}
}

// The dispatched list pages by seq past 2^31-1: seq is a bigint, and the
// cursor's parameter must be one too (an int4 cursor failed every page
// once seqs passed it, and any such cursor on a small table).
func TestDispatchedListPastInt32(t *testing.T) {
	f := newPoisonFixture(t)
	cfg, err := f.cfg.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	table := pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize()
	const big = int64(1)<<31 + 5
	for _, seq := range []int64{big, big + 1, big + 2} {
		if _, err := f.pool.Exec(f.ctx, "INSERT INTO "+table+" (seq, event_id, aggregate_id, type, payload, dispatched_at)"+
			" VALUES ($1, gen_random_uuid(), 'k', 't.x', '{}', now())", seq); err != nil {
			t.Fatal(err)
		}
	}
	if got := f.events(admin.EventsOptions{State: admin.StateDispatched}); !slices.Equal(got, []int64{big + 2, big + 1, big}) {
		t.Errorf("first page %v", got)
	}
	if got := f.events(admin.EventsOptions{State: admin.StateDispatched, After: big + 2}); !slices.Equal(got, []int64{big + 1, big}) {
		t.Errorf("page after %d: %v", big+2, got)
	}
	if got := f.events(admin.EventsOptions{State: admin.StateDispatched, After: 1 << 40}); len(got) != 3 {
		t.Errorf("page after 2^40: %v", got)
	}
}

// A filter on the dispatched list walks at most DispatchedScanRows rows a
// page (here 10): a page may come back short, with where the next one
// starts, and following the pages finds every match.
func TestDispatchedFilterScanIsBounded(t *testing.T) {
	defer admin.SetDispatchedScanRows(10)()
	f := newPoisonFixture(t)
	cfg, err := f.cfg.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	table := pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize()
	var want []int64
	for i := 1; i <= 30; i++ {
		typ := "other"
		if i <= 5 || i == 17 {
			typ = "match"
		}
		var seq int64
		if err := f.pool.QueryRow(f.ctx, "INSERT INTO "+table+" (event_id, aggregate_id, type, payload, dispatched_at)"+
			" VALUES (gen_random_uuid(), 'k', $1, '{}', now()) RETURNING seq", typ).Scan(&seq); err != nil {
			t.Fatal(err)
		}
		if typ == "match" {
			want = append([]int64{seq}, want...) // newest first
		}
	}
	var got []int64
	pages, firstLen := 0, -1
	q := admin.EventsOptions{State: admin.StateDispatched, Type: "match", Limit: 3}
	for {
		p, err := f.st.EventsPage(f.ctx, q)
		if err != nil {
			t.Fatal(err)
		}
		pages++
		if firstLen < 0 {
			firstLen = len(p.Events)
		}
		got = append(got, infoIDs(p.Events)...)
		if p.NextAfter == 0 || pages > 20 {
			break
		}
		q.After = p.NextAfter
	}
	if !slices.Equal(got, want) {
		t.Errorf("pages found %v, want %v", got, want)
	}
	if firstLen != 0 {
		t.Errorf("the first page has %d events: the scan walked past the newest 10 rows", firstLen)
	}
	// Unfiltered, the list is as before: full pages, no bound.
	p, err := f.st.EventsPage(f.ctx, admin.EventsOptions{State: admin.StateDispatched, Limit: 25})
	if err != nil || len(p.Events) != 25 {
		t.Errorf("unfiltered: %d events, %v", len(p.Events), err)
	}
}

// Every argument an Admin method refuses is an ErrInvalid, with its text
// as it was: a caller tells a bad request from a failure by the error's
// type, not by matching its text.
func TestArgumentErrorsAreErrInvalid(t *testing.T) {
	_, _, st := opsStore(t)
	ctx := context.Background()
	now := time.Now()
	_, badID := st.Event(ctx, 0, "not-a-uuid")
	_, badRange := st.EventsPage(ctx, admin.EventsOptions{State: admin.StatePending, Limit: 10, CreatedAfter: now, CreatedBefore: now.Add(-time.Hour)})
	_, badReason := st.Park(ctx, admin.Selector{Type: "a.b"}, "")
	_, badSelector := st.Retry(ctx, admin.Selector{})
	for _, c := range []struct {
		err  error
		text string
	}{
		{badID, "is not a UUID"}, {badRange, "created-before"}, {badReason, "reason is required"}, {badSelector, "selector is empty"},
	} {
		if !errors.Is(c.err, admin.ErrInvalid) || !strings.Contains(fmt.Sprint(c.err), c.text) {
			t.Errorf("error %v: want ErrInvalid saying %q", c.err, c.text)
		}
	}
	if _, err := st.Event(ctx, 1, ""); errors.Is(err, admin.ErrInvalid) || !errors.Is(err, admin.ErrEventNotFound) {
		t.Errorf("a missing event: %v, want ErrEventNotFound and no ErrInvalid", err)
	}
}
