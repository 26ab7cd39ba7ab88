package table_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// While one claim holds an aggregate's first event, a second claim leaves
// that aggregate's later events out and says so, so its relay returns soon.
func TestClaimReportsGatedCandidates(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	in := newInstance(t, pool, cfg)
	ctx := context.Background()
	agg := "00000000-0000-0000-0000-0000000000aa"
	if err := in.Produce(ctx, []core.Event{{AggregateID: agg, Type: "a.b", Payload: []byte(`{}`)}, {AggregateID: agg, Type: "a.b", Payload: []byte(`{}`)}}, true); err != nil {
		t.Fatal(err)
	}
	first, err := in.s.Claim(ctx, core.ClaimOptions{Limit: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer first.Release(ctx)
	if got := len(first.Events()); got != 1 {
		t.Fatalf("first claim got %d events, want 1", got)
	}
	if tr, ok := first.(core.Truncated); !ok || tr.Truncated() {
		t.Fatalf("first claim: Truncated implemented %v, reports %v; want implemented and false", ok, ok && tr.Truncated())
	}
	second, err := in.s.Claim(ctx, core.ClaimOptions{Limit: 10})
	if err != nil {
		t.Fatal(err)
	}
	defer second.Release(ctx)
	if got := len(second.Events()); got != 0 {
		t.Fatalf("second claim got %d events of an aggregate whose first event is claimed", got)
	}
	if tr, ok := second.(core.Truncated); !ok || !tr.Truncated() {
		t.Fatal("second claim does not report the event its gate held back")
	}
}

// Rows another transaction holds never hide the claimable events after
// them: with the lowest pending rows locked elsewhere (a frozen relay's
// open claims), a claim returns the other aggregates' events, holds back
// those of the locked rows' aggregates, and says it left events out.
func TestClaimStepsOverLockedRows(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	in := newInstance(t, pool, cfg)
	ctx := context.Background()
	var evs []core.Event
	for i := range 600 {
		// The first 500 of aggregates of their own, which another
		// transaction will hold; then one more of each of the first ten,
		// held back behind them; then 90 free aggregates.
		agg := fmt.Sprintf("locked-%d", i)
		switch {
		case i >= 510:
			agg = fmt.Sprintf("free-%d", i)
		case i >= 500:
			agg = fmt.Sprintf("locked-%d", i-500)
		}
		evs = append(evs, core.Event{AggregateID: agg, Type: "a.b", Payload: []byte(`{}`)})
	}
	if err := in.Produce(ctx, evs, true); err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	tag, err := tx.Exec(ctx, "SELECT seq FROM (SELECT seq FROM "+in.table()+" ORDER BY seq LIMIT 500 FOR UPDATE) l")
	if err != nil || tag.RowsAffected() != 500 {
		t.Fatalf("lock the lowest rows: %v, %d", err, tag.RowsAffected())
	}
	c, err := in.s.Claim(ctx, core.ClaimOptions{Limit: 500})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release(ctx)
	got := map[string]int{}
	for _, e := range c.Events() {
		got[strings.SplitN(e.AggregateID, "-", 2)[0]]++
	}
	if got["free"] != 90 || got["locked"] != 0 {
		t.Fatalf("claimed %d events of free aggregates (want 90) and %d behind locked rows (want 0)", got["free"], got["locked"])
	}
	if tr, ok := c.(core.Truncated); !ok || !tr.Truncated() {
		t.Fatal("the claim does not report the events it held back")
	}
}
