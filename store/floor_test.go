package store_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// While claims come back full, the next one starts at the previous one's
// lowest candidate, skipping the index entries of rows just dispatched. An
// event released below that point (its relay crashed) must still be claimed
// again: at the latest after a second, or at once after a short claim.
func TestReleasedEventBelowScanFloorIsClaimedAgain(t *testing.T) {
	ctx := context.Background()
	pool, cfg := pgtest.Schema(t)
	in := newInstance(t, pool, cfg)
	var evs []core.Event
	for i := range 40 {
		evs = append(evs, core.Event{AggregateID: fmt.Sprintf("00000000-0000-4000-8000-%012d", i), Type: "a.b", Payload: []byte(`{}`)})
	}
	if err := in.Produce(ctx, evs, true); err != nil {
		t.Fatal(err)
	}
	claim := func(limit int) core.Claim {
		t.Helper()
		c, err := in.s.Claim(ctx, core.ClaimRequest{Limit: limit})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	first := claim(10) // full: the floor moves to its lowest id
	crashed := first.Events()[0].ID
	second := claim(10) // full, above the first
	defer second.Release(ctx)
	if err := first.Release(ctx); err != nil { // as if its relay died
		t.Fatal(err)
	}
	third := claim(5) // full again: the floor is above the released events
	defer third.Release(ctx)

	deadline := time.Now().Add(3 * time.Second)
	for {
		c := claim(5)
		found := false
		for _, e := range c.Events() {
			found = found || e.ID == crashed
		}
		done := make([]int64, 0, len(c.Events()))
		for _, e := range c.Events() {
			done = append(done, e.ID)
		}
		if err := c.Complete(ctx, done, nil); err != nil {
			t.Fatal(err)
		}
		if found {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("event %d, released below the scan floor, was not claimed again within 3s", crashed)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
