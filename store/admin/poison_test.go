package admin_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/admin"
	"github.com/outboxhq/outbox/store/table"
)

type poisonFixture struct {
	t    *testing.T
	ctx  context.Context
	pool *pgxpool.Pool
	src  *table.Source
	st   *admin.Admin
	cfg  store.Config
}

func newPoisonFixture(t *testing.T) *poisonFixture {
	t.Helper()
	pool, cfg := pgtest.Schema(t)
	src, err := table.New(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	st, err := admin.New(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	return &poisonFixture{t: t, ctx: context.Background(), pool: pool, src: src, st: st, cfg: cfg}
}

// write commits one event per type, all for aggregate agg, and returns
// their ids in order.
func (f *poisonFixture) write(agg string, types ...string) []int64 {
	f.t.Helper()
	w, err := outbox.NewWriter(outbox.WriterOptions{Store: f.cfg})
	if err != nil {
		f.t.Fatal(err)
	}
	tx, err := f.pool.Begin(f.ctx)
	if err != nil {
		f.t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(f.ctx) }()
	var msgs []outbox.Message
	for _, typ := range types {
		msgs = append(msgs, outbox.Message{AggregateID: agg, Type: typ, Payload: map[string]string{"t": typ}})
	}
	if err := w.Write(f.ctx, tx, msgs...); err != nil {
		f.t.Fatal(err)
	}
	rows, err := tx.Query(f.ctx, `SELECT seq FROM `+f.table()+` WHERE aggregate_id = $1 ORDER BY seq DESC LIMIT $2`, agg, len(types))
	if err != nil {
		f.t.Fatal(err)
	}
	ids := make([]int64, len(types))
	for i := len(types) - 1; rows.Next(); i-- {
		if err := rows.Scan(&ids[i]); err != nil {
			f.t.Fatal(err)
		}
	}
	if err := rows.Err(); err != nil {
		f.t.Fatal(err)
	}
	if err := tx.Commit(f.ctx); err != nil {
		f.t.Fatal(err)
	}
	return ids
}

func (f *poisonFixture) table() string { return `"` + f.cfg.Schema + `"."events_outbox"` }

// claim takes one ordered claim and returns it with its event ids.
func (f *poisonFixture) claim(limit int) (core.Claim, []int64) {
	f.t.Helper()
	c, err := f.src.Claim(f.ctx, core.ClaimOptions{Limit: limit})
	if err != nil {
		f.t.Fatal(err)
	}
	var ids []int64
	for _, e := range c.Events() {
		ids = append(ids, e.Seq)
	}
	return c, ids
}

// cycle claims as a relay does: events in fail fail permanently, later
// events of their aggregate are left pending, the rest are marked done.
// It returns the ids it claimed.
func (f *poisonFixture) cycle(fail map[int64]string) []int64 {
	f.t.Helper()
	c, ids := f.claim(100)
	var done []int64
	var failed []core.Failure
	stopped := map[string]bool{}
	for _, e := range c.Events() {
		switch reason, ok := fail[e.Seq]; {
		case stopped[e.AggregateID]:
		case ok:
			failed = append(failed, core.Failure{Seq: e.Seq, Reason: reason})
			stopped[e.AggregateID] = true
		default:
			done = append(done, e.Seq)
		}
	}
	if err := c.Complete(f.ctx, done, failed); err != nil {
		f.t.Fatal(err)
	}
	return ids
}

func (f *poisonFixture) stuck(q admin.StuckOptions) map[int64]admin.StuckEvent {
	f.t.Helper()
	list, err := f.st.Stuck(f.ctx, q)
	if err != nil {
		f.t.Fatal(err)
	}
	m := make(map[int64]admin.StuckEvent, len(list))
	for i, e := range list {
		if i > 0 && list[i-1].Seq >= e.Seq {
			f.t.Fatalf("stuck list not in id order: %d before %d", list[i-1].Seq, e.Seq)
		}
		m[e.Seq] = e
	}
	return m
}

func contains(ids []int64, id int64) bool {
	for _, x := range ids {
		if x == id {
			return true
		}
	}
	return false
}

func TestPoisonHoldsOnlyItsAggregateUntilRetried(t *testing.T) {
	f := newPoisonFixture(t)
	bad, good := uuid.NewString(), uuid.NewString()
	badIDs := f.write(bad, "a.first", "a.second", "a.third")
	goodIDs := f.write(good, "b.first")

	// The first event of bad fails permanently; the rest of bad was in the
	// same claim but not attempted, as the relay's lane does.
	c, ids := f.claim(100)
	if len(ids) != 4 {
		t.Fatalf("first claim got %v, want all 4 events", ids)
	}
	if err := c.Complete(f.ctx, goodIDs, []core.Failure{{Seq: badIDs[0], Reason: "message too large"}}); err != nil {
		t.Fatal(err)
	}
	more := f.write(good, "b.second")
	got := f.cycle(nil)
	if contains(got, badIDs[1]) || contains(got, badIDs[2]) || !contains(got, more[0]) {
		t.Fatalf("claim after a permanent failure got %v; want only %v (good aggregate), not %v", got, more, badIDs[1:])
	}

	list := f.stuck(admin.StuckOptions{})
	e, ok := list[badIDs[0]]
	if !ok || len(list) != 1 {
		t.Fatalf("Stuck = %+v, want only the held event %d", list, badIDs[0])
	}
	if !e.Held || e.LastError != "message too large" || e.Attempts != 1 || e.HeldBack != 2 || !e.Blocking || e.WaitsFor != 0 {
		t.Fatalf("held event listed as %+v", e)
	}
	if e.AggregateID != bad || e.Type != "a.first" || e.ID == "" {
		t.Fatalf("held event identity %+v", e)
	}

	// Pending events past the age threshold are listed too, with what
	// they wait for.
	if _, err := f.pool.Exec(f.ctx, `UPDATE `+f.table()+` SET created_at = now() - interval '1 hour' WHERE seq = $1`, badIDs[2]); err != nil {
		t.Fatal(err)
	}
	list = f.stuck(admin.StuckOptions{OlderThan: 10 * time.Minute})
	if w := list[badIDs[2]]; w.WaitsFor != badIDs[0] || w.Held || w.Blocking {
		t.Fatalf("old pending event listed as %+v, want WaitsFor %d", w, badIDs[0])
	}
	if _, ok := list[badIDs[1]]; ok {
		t.Fatalf("young pending event %d listed", badIDs[1])
	}

	n, err := f.st.Retry(f.ctx, admin.Selector{AggregateID: bad})
	if err != nil || n != 1 {
		t.Fatalf("Retry = %d, %v; want 1 event released", n, err)
	}
	got = f.cycle(nil)
	if len(got) != 3 || got[0] != badIDs[0] {
		t.Fatalf("claim after Retry got %v, want %v", got, badIDs)
	}
	if list := f.stuck(admin.StuckOptions{OlderThan: time.Nanosecond}); len(list) != 0 {
		t.Fatalf("Stuck after everything went out = %+v", list)
	}
}

func TestParkLetsTheAggregateProceedAndUnparkKeepsIdentity(t *testing.T) {
	f := newPoisonFixture(t)
	agg := uuid.NewString()
	ids := f.write(agg, "a.one", "a.two")
	f.cycle(map[int64]string{ids[0]: "unroutable"})
	var uid string
	for _, e := range f.stuck(admin.StuckOptions{}) {
		uid = e.ID
	}

	if _, err := f.st.Park(f.ctx, admin.Selector{Seqs: ids[:1]}, "  "); err == nil || !strings.Contains(err.Error(), "reason") {
		t.Fatalf("Park without a reason: err = %v", err)
	}
	n, err := f.st.Park(f.ctx, admin.Selector{Seqs: ids[:1], AggregateID: agg}, "bad payload, see ticket 12")
	if err != nil || n != 1 {
		t.Fatalf("Park = %d, %v", n, err)
	}
	if got := f.cycle(nil); len(got) != 1 || got[0] != ids[1] {
		t.Fatalf("claim after Park got %v, want the later event %d", got, ids[1])
	}
	if list := f.stuck(admin.StuckOptions{}); len(list) != 0 {
		t.Fatalf("parked event listed without IncludeParked: %+v", list)
	}
	p, ok := f.stuck(admin.StuckOptions{IncludeParked: true})[ids[0]]
	if !ok || p.ParkedAt.IsZero() || p.ParkedReason != "bad payload, see ticket 12" || p.LastError != "unroutable" || p.Blocking {
		t.Fatalf("parked event listed as %+v", p)
	}
	if n, err := f.st.Park(f.ctx, admin.Selector{Seqs: ids[:1]}, "again"); err != nil || n != 0 {
		t.Fatalf("Park of a parked event = %d, %v; want 0", n, err)
	}

	n, err = f.st.Unpark(f.ctx, admin.Selector{Type: "a.one"})
	if err != nil || n != 1 {
		t.Fatalf("Unpark = %d, %v", n, err)
	}
	c, _ := f.claim(100)
	evs := c.Events()
	if len(evs) != 1 || evs[0].Seq != ids[0] || evs[0].ID != uid {
		t.Fatalf("claim after Unpark got %+v, want event %d with uid %s", evs, ids[0], uid)
	}
	if err := c.Complete(f.ctx, []int64{ids[0]}, nil); err != nil {
		t.Fatal(err)
	}
	if n, err := f.st.Unpark(f.ctx, admin.Selector{Seqs: ids}); err != nil || n != 0 {
		t.Fatalf("Unpark of dispatched events = %d, %v; want 0", n, err)
	}
}

// An operator command on an event a relay holds waits for the claim and
// then leaves a dispatched event alone.
func TestParkWaitsForAClaimAndSkipsWhatWentOut(t *testing.T) {
	f := newPoisonFixture(t)
	ids := f.write(uuid.NewString(), "a.one")
	c, got := f.claim(10)
	if len(got) != 1 {
		t.Fatalf("claim got %v", got)
	}
	type result struct {
		n   int64
		err error
	}
	res := make(chan result, 1)
	go func() {
		n, err := f.st.Park(f.ctx, admin.Selector{Seqs: ids}, "by hand")
		res <- result{n, err}
	}()
	// Wait until the park is blocked on the claim's row lock.
	deadline := time.Now().Add(10 * time.Second)
	for {
		var waiting bool
		err := f.pool.QueryRow(f.ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND query LIKE '%UPDATE%parked_at = now()%'
			  AND strpos(query, $1) > 0)`, f.cfg.Schema).Scan(&waiting)
		if err != nil {
			t.Fatal(err)
		}
		if waiting {
			break
		}
		select {
		case r := <-res:
			t.Fatalf("Park returned %d, %v while the claim was open", r.n, r.err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("Park never waited for the claim's lock")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := c.Complete(f.ctx, ids, nil); err != nil {
		t.Fatal(err)
	}
	if r := <-res; r.err != nil || r.n != 0 {
		t.Fatalf("Park after dispatch = %d, %v; want 0", r.n, r.err)
	}
}

func TestOperatorInputErrors(t *testing.T) {
	f := newPoisonFixture(t)
	cases := []struct {
		name string
		run  func() error
		want string
	}{
		{"empty selector", func() error { _, err := f.st.Retry(f.ctx, admin.Selector{}); return err }, "selector is empty"},
		{"empty selector park", func() error { _, err := f.st.Park(f.ctx, admin.Selector{}, "x"); return err }, "selector is empty"},
		{"empty selector unpark", func() error { _, err := f.st.Unpark(f.ctx, admin.Selector{}); return err }, "selector is empty"},
		{"bad aggregate", func() error { _, err := f.st.Retry(f.ctx, admin.Selector{AggregateID: "order\x01"}); return err }, "control character"},
		{"bad id", func() error { _, err := f.st.Retry(f.ctx, admin.Selector{Seqs: []int64{0}}); return err }, "not a valid event position"},
		{"too many ids", func() error {
			_, err := f.st.Retry(f.ctx, admin.Selector{Seqs: make([]int64, admin.MaxSelected+1)})
			return err
		}, "over the maximum"},
		{"long reason", func() error {
			_, err := f.st.Park(f.ctx, admin.Selector{Type: "x"}, strings.Repeat("r", 3000))
			return err
		}, "over the limit"},
		{"negative age", func() error { _, err := f.st.Stuck(f.ctx, admin.StuckOptions{OlderThan: -time.Second}); return err }, "OlderThan"},
		{"huge limit", func() error {
			_, err := f.st.Stuck(f.ctx, admin.StuckOptions{Limit: admin.MaxSelected + 1})
			return err
		}, "Limit"},
	}
	for _, c := range cases {
		err := c.run()
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err = %v, want one mentioning %q", c.name, err, c.want)
		}
	}
}

func TestRetryReleasesABackingOffEvent(t *testing.T) {
	f := newPoisonFixture(t)
	agg := uuid.NewString()
	ids := f.write(agg, "a.one", "a.two")
	c, _ := f.claim(10)
	if err := c.Complete(f.ctx, nil, []core.Failure{{Seq: ids[0], Reason: "timeout", RetryAt: time.Now().Add(time.Hour)}}); err != nil {
		t.Fatal(err)
	}
	if got := f.cycle(nil); len(got) != 0 {
		t.Fatalf("claim during backoff got %v", got)
	}
	e := f.stuck(admin.StuckOptions{OlderThan: time.Nanosecond})[ids[0]]
	if e.Held || e.RetryAt.Before(time.Now().Add(50*time.Minute)) || e.LastError != "timeout" || e.HeldBack != 1 {
		t.Fatalf("backing-off event listed as %+v", e)
	}
	if n, err := f.st.Retry(f.ctx, admin.Selector{Seqs: ids}); err != nil || n != 1 {
		t.Fatalf("Retry = %d, %v; want 1 (only the failed event)", n, err)
	}
	if got := f.cycle(nil); len(got) != 2 {
		t.Fatalf("claim after Retry got %v, want both events", got)
	}
}
