package store_test

import (
	"context"
	"testing"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store/pgtest"
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
