package logrelay

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pglogrepl"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// The ledger keeps a log-only event while a session could resume before
// the end of its transaction: unknown until its commit arrives, then its
// end; after a new session begins, an open transaction of the session
// before ended by its horizon; an event it never read, by the WAL
// position when it was first asked about.
func TestLedgerKeepsEventsUntilTheResumePassesTheirTransaction(t *testing.T) {
	var l ledger
	l.read(50) // in a transaction still open
	l.read(60)
	l.read(70)
	l.committed([]int64{60}, 100)
	l.committed([]int64{70}, 200)
	keep := l.unsettled([]int64{50, 60, 70, 999}, 150, 1000)
	// 60 sits below the resume position but its transaction ends after:
	// kept until 100 is passed; 70's transaction ends at 200.
	want := map[int64]bool{50: true, 60: false, 70: true, 999: true}
	if fmt.Sprint(keep) != fmt.Sprint(want) {
		t.Fatalf("unsettled at 150 = %v, want %v", keep, want)
	}
	if _, ok := l.ends[60]; ok {
		t.Error("an event settled at the resume position is still remembered")
	}
	// 999 was first asked about at WAL 1000: kept until 1000 is passed,
	// whatever the WAL position is when asked again.
	if keep := l.unsettled([]int64{999}, 999, 5000); !keep[999] {
		t.Error("an unknown event was let go before the resume position passed the WAL position when first asked")
	}
	if keep := l.unsettled([]int64{999}, 1000, 5000); keep[999] {
		t.Error("an unknown event is kept past the WAL position when first asked")
	}
	// A transaction whose commit a session did not read ended before the
	// next session's horizon.
	l.newSession(1300)
	if keep := l.unsettled([]int64{50}, 1299, 5000); !keep[50] {
		t.Error("an event of an open transaction let go before the next session's horizon")
	}
	if keep := l.unsettled([]int64{50}, 1300, 5000); keep[50] {
		t.Error("an event of an open transaction kept past the next session's horizon")
	}
	// Unknown resume position (0): everything is kept.
	l.read(80)
	l.committed([]int64{80}, 1400)
	if keep := l.unsettled([]int64{80, 1}, 0, 5000); !keep[80] || !keep[1] {
		t.Errorf("events let go with no resume position known: %v", keep)
	}
}

// The ledger's memory is bounded; an event it forgot is asked about as
// one it never read, which keeps it at least as long.
func TestLedgerIsBounded(t *testing.T) {
	var l ledger
	for i := range maxLedger + 10 {
		l.read(int64(i))
	}
	if n := len(l.ends); n > maxLedger {
		t.Fatalf("the ledger remembers %d events, bound %d", n, maxLedger)
	}
}

// When the rows a session reads again after a takeover cannot be looked
// up, the claim fails and its events go back to the front of the buffer,
// in order: they are not offered, so a row published and marked before
// the takeover is not published again. It used to be.
func TestClaimFailsWhenRowsReadAgainCannotBeLookedUp(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	cfg, err := cfg.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	var seqs []int64
	var ids []string
	err = pool.QueryRow(ctx, `WITH i AS (INSERT INTO `+cfg.Names().Outbox+` (aggregate_id, type, payload, dispatched_at)
SELECT 'a', 'a.b', '{}', CASE WHEN g % 2 = 0 THEN now() END FROM generate_series(1, 4) g RETURNING seq, event_id)
SELECT array_agg(seq ORDER BY seq), array_agg(event_id::text ORDER BY seq) FROM i`).Scan(&seqs, &ids)
	if err != nil {
		t.Fatal(err)
	}
	broken := pgtest.NewProcess(t, 2)
	r, err := New(broken.Pool, &nopPublisher{}, Options{Store: cfg})
	if err != nil {
		t.Fatal(err)
	}
	s := &stream{r: r, tracker: newTracker(0), freed: make(chan struct{}, 1)}
	x := s.tracker.begin()
	var want []int64
	for i, seq := range seqs {
		it := &item{ev: core.Event{Seq: seq, ID: ids[i], AggregateID: "a"}, row: true, maybeSent: true, txn: x}
		s.tracker.add(x)
		s.events.Add(1)
		s.buffered = append(s.buffered, it)
		want = append(want, seq)
	}
	later := &item{ev: core.Event{Seq: 1 << 40, AggregateID: "a"}, txn: x} // a message read after them
	s.tracker.add(x)
	s.events.Add(1)
	s.buffered = append(s.buffered, later)
	want = append(want, later.ev.Seq)
	s.tracker.commit(x, pglogrepl.LSN(1<<41))
	buffered := func() []int64 {
		var out []int64
		for _, it := range s.buffered {
			out = append(out, it.ev.Seq)
		}
		return out
	}

	broken.Pool.Close() // every lookup fails
	for range 2 {
		c, err := s.Claim(ctx, core.ClaimOptions{Limit: 3})
		if err == nil {
			t.Fatalf("a claim whose lookup failed returned events %v", c.Events())
		}
		if got := buffered(); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("after a failed claim the buffer holds %v, want %v", got, want)
		}
	}

	// Once the lookup works, the dispatched rows are left out.
	r.pool = pool
	c, err := s.Claim(ctx, core.ClaimOptions{Limit: 10})
	if err != nil {
		t.Fatal(err)
	}
	var got []int64
	for _, e := range c.Events() {
		got = append(got, e.Seq)
	}
	if wantLeft := []int64{seqs[0], seqs[2], later.ev.Seq}; fmt.Sprint(got) != fmt.Sprint(wantLeft) {
		t.Fatalf("claimed %v, want the rows not dispatched and the message: %v", got, wantLeft)
	}
	if n := s.events.Load(); n != 3 {
		t.Fatalf("%d events in flight, want 3: the dispatched rows are done", n)
	}
}

type nopPublisher struct{}

func (nopPublisher) Publish(context.Context, *core.Event) error { return nil }
func (nopPublisher) Close() error                               { return nil }
