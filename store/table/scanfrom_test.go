package table_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// While a backlog drains, unordered claims start their scan above the
// bottom of the pending ids. An event that becomes claimable below that
// start (here one released by another claim) is still claimed within a
// quarter of a second. Ordered claims read from the bottom: the released
// event is claimed at once, and its aggregate's later events never before
// it.
func TestEventBelowScanStartIsClaimedSoon(t *testing.T) {
	for _, unordered := range []bool{false, true} {
		t.Run(fmt.Sprintf("unordered=%v", unordered), func(t *testing.T) { testEventBelowScanStart(t, unordered) })
	}
}

func testEventBelowScanStart(t *testing.T, unordered bool) {
	pool, cfg := pgtest.Schema(t)
	in := newInstance(t, pool, cfg)
	ctx := context.Background()
	agg := func(i int) string { return fmt.Sprintf("00000000-0000-4000-8000-%012x", i) }
	var evs []core.Event
	for i := range 10 {
		a := agg(i)
		if i == 4 {
			a = agg(0) // the released event's aggregate continues here
		}
		evs = append(evs, core.Event{AggregateID: a, Type: "a.b", Payload: []byte(`{}`)})
	}
	if err := in.Produce(ctx, evs, true); err != nil {
		t.Fatal(err)
	}
	claim := func(limit int) core.Claim {
		t.Helper()
		c, err := in.s.Claim(ctx, core.ClaimOptions{Limit: limit, Unordered: unordered})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Release(context.WithoutCancel(ctx)) })
		return c
	}
	ids := func(c core.Claim) (out []int64) {
		for _, e := range c.Events() {
			out = append(out, e.Seq)
		}
		return out
	}
	held := claim(1) // the first event, held by "another relay"
	first := ids(held)[0]
	claim(1)                           // full: the next claims start at the second event
	time.Sleep(300 * time.Millisecond) // past the start's lifetime: the next claim scans from the bottom
	claim(1)                           // full, from the bottom: claims now start at the third event
	if err := held.Release(ctx); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	for {
		c := claim(3)
		got := ids(c)
		if slices.Contains(got, first) {
			break
		}
		if !unordered && slices.Contains(got, first+4) {
			t.Fatalf("claim %v took event %d while the earlier event %d of its aggregate was pending and unclaimed", got, first+4, first)
		}
		if err := c.Release(ctx); err != nil {
			t.Fatal(err)
		}
		if time.Since(start) > 2*time.Second {
			t.Fatalf("the released event %d was not claimed within 2s", first)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if d := time.Since(start); d > time.Second {
		t.Fatalf("the released event was claimed after %v, want within a quarter of a second or so", d)
	}
	t.Logf("released event claimed again after %v", time.Since(start).Round(time.Millisecond))
}
