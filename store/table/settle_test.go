package table_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/google/uuid"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store/admin"
	"github.com/outboxhq/outbox/store/table"
)

// An event's unit is the partition sharing gives its aggregate, as
// PostgreSQL computes it for the partition index: compared for many
// aggregates, ordered and unordered, in every partition.
func TestClaimedUnitIsTheSharingPartition(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	in := newInstance(t, pool, cfg)
	ctx := context.Background()
	var evs []core.Event
	for i := range 600 {
		agg := uuid.NewString()
		switch i % 3 {
		case 1:
			agg = fmt.Sprintf("order-%d", i)
		case 2:
			agg = fmt.Sprintf("ünï-%d-%x", i, i*7919)
		}
		evs = append(evs, core.Event{AggregateID: agg, Type: "a.b", Payload: []byte(`{}`)})
	}
	if err := in.Produce(ctx, evs, true); err != nil {
		t.Fatal(err)
	}
	if name, n := in.s.Units(); name != in.cfg.Schema+"."+in.cfg.Table || n != table.Partitions {
		t.Fatalf("Units() = %q, %d; want %q, %d", name, n, in.cfg.Schema+"."+in.cfg.Table, table.Partitions)
	}
	for _, unordered := range []bool{false, true} {
		c, err := in.s.Claim(ctx, core.ClaimOptions{Limit: 1000, Unordered: unordered})
		if err != nil {
			t.Fatal(err)
		}
		got := c.Events()
		if len(got) != len(evs) {
			t.Fatalf("unordered %v: claimed %d events, want %d", unordered, len(got), len(evs))
		}
		aggs := make([]string, len(got))
		for i, e := range got {
			aggs[i] = e.AggregateID
		}
		var want []int
		err = pool.QueryRow(ctx, "SELECT array_agg(hashtext(a) & 31 ORDER BY i) FROM unnest($1::text[]) WITH ORDINALITY AS u(a, i)", aggs).Scan(&want)
		if err != nil {
			t.Fatal(err)
		}
		seen := map[int]bool{}
		for i, e := range got {
			if e.Unit != want[i] {
				t.Errorf("unordered %v: event %d of aggregate %q has unit %d, want partition %d", unordered, e.Seq, e.AggregateID, e.Unit, want[i])
			}
			seen[e.Unit] = true
		}
		if len(seen) != table.Partitions {
			t.Errorf("unordered %v: the events fell in %d units, want all %d", unordered, len(seen), table.Partitions)
		}
		if err := c.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// A sent event is unsettled while its row may be offered again: pending,
// held, parked. Dispatched, deleted, or a seq whose row is another event
// is settled.
func TestUnsettled(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	in := newInstance(t, pool, cfg)
	ctx := context.Background()
	var evs []core.Event
	for i := range 6 {
		evs = append(evs, core.Event{AggregateID: fmt.Sprintf("agg-%d", i), Type: "a.b", Payload: []byte(`{}`)})
	}
	if err := in.Produce(ctx, evs, true); err != nil {
		t.Fatal(err)
	}
	c, err := in.s.Claim(ctx, core.ClaimOptions{Limit: 10})
	if err != nil {
		t.Fatal(err)
	}
	got := c.Events()
	if len(got) != 6 {
		t.Fatalf("claimed %d events, want 6", len(got))
	}
	sent := func(e core.Event) core.Sent { return core.Sent{Unit: e.Unit, Seq: e.Seq, ID: e.ID, Replays: e.Replays} }
	all := make([]core.Sent, len(got))
	for i, e := range got {
		all[i] = sent(e)
	}
	// In an open claim every one is pending.
	if u, err := in.s.Unsettled(ctx, all); err != nil || len(u) != 6 {
		t.Fatalf("Unsettled during the claim = %v, %v; want all 6", u, err)
	}
	// 0 done, 1 held, 2 left pending, 3 parked, 4 deleted once done, 5 asked under another id.
	err = c.Complete(ctx, []int64{got[0].Seq, got[4].Seq}, []core.Failure{{Seq: got[1].Seq, Reason: "refused"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := in.ad.Park(ctx, admin.Selector{Seqs: []int64{got[3].Seq}}, "set aside"); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "DELETE FROM "+in.table()+" WHERE seq = $1", got[4].Seq); err != nil {
		t.Fatal(err)
	}
	ask := append([]core.Sent{}, all...)
	ask[5].ID = uuid.NewString()
	ask = append(ask, core.Sent{Seq: got[5].Seq + 1000, ID: got[5].ID}) // no such row
	u, err := in.s.Unsettled(ctx, ask)
	if err != nil {
		t.Fatal(err)
	}
	want := []core.Sent{all[1], all[2], all[3]}
	if fmt.Sprint(u) != fmt.Sprint(want) {
		t.Fatalf("Unsettled = %v, want %v (held, pending, parked)", u, want)
	}
	if u, err := in.s.Unsettled(ctx, nil); err != nil || len(u) != 0 {
		t.Fatalf("Unsettled(nil) = %v, %v", u, err)
	}
	// A replay makes an event pending again, a new delivery: the send
	// before it is settled, and the claim gives the replay, whose send is
	// unsettled until recorded.
	if _, err := in.ad.Replay(ctx, admin.Selector{Seqs: []int64{got[0].Seq}}, admin.ReplayOptions{}); err != nil {
		t.Fatal(err)
	}
	if u, err := in.s.Unsettled(ctx, all[:1]); err != nil || len(u) != 0 {
		t.Fatalf("Unsettled of the send before a replay = %v, %v; want it settled", u, err)
	}
	c, err = in.s.Claim(ctx, core.ClaimOptions{Limit: 10})
	if err != nil {
		t.Fatal(err)
	}
	var replay core.Event
	for _, e := range c.Events() {
		if e.Seq == got[0].Seq {
			replay = e
		}
	}
	if replay.Replays != 1 || replay.ID != got[0].ID {
		t.Fatalf("the replayed event was claimed as %+v, want its id with Replays 1", replay)
	}
	if u, err := in.s.Unsettled(ctx, []core.Sent{sent(replay)}); err != nil || len(u) != 1 {
		t.Fatalf("Unsettled of the replay's send = %v, %v; want it", u, err)
	}
	if err := c.Complete(ctx, []int64{replay.Seq}, nil); err != nil {
		t.Fatal(err)
	}
	if u, err := in.s.Unsettled(ctx, []core.Sent{sent(replay)}); err != nil || len(u) != 0 {
		t.Fatalf("Unsettled of the replay once recorded = %v, %v; want it settled", u, err)
	}
}

// The hand-off source reads the handoff view, but settles by the outbox
// and under its name: its units are the table source's.
func TestHandOffSourceUnits(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	in := newInstance(t, pool, cfg)
	h, err := table.NewHandOff(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	name, n := h.Units()
	if wantName, wantN := in.s.Units(); name != wantName || n != wantN {
		t.Fatalf("hand-off source Units() = %q, %d; want the table's %q, %d", name, n, wantName, wantN)
	}
	ctx := context.Background()
	if err := in.Produce(ctx, []core.Event{{AggregateID: "a", Type: "a.b", Payload: []byte(`{}`)}}, true); err != nil {
		t.Fatal(err)
	}
	seqs, err := in.Pending(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var id string
	if err := pool.QueryRow(ctx, "SELECT event_id::text FROM "+in.table()+" WHERE seq = $1", seqs[0]).Scan(&id); err != nil {
		t.Fatal(err)
	}
	// Not handed off, so not in the view: pending in the outbox all the same.
	if u, err := h.Unsettled(ctx, []core.Sent{{Seq: seqs[0], ID: id}}); err != nil || len(u) != 1 {
		t.Fatalf("hand-off source Unsettled of a pending row = %v, %v; want it", u, err)
	}
}
