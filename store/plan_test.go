package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store/pgtest"
)

// An outbox's statistics mostly describe dispatched rows. Planned from
// them, the claim once joined its candidates to the gate in nested loops,
// and a claim of 500 new events took over ten seconds. This is a guard
// against that plan coming back, not a speed figure: the claim takes
// milliseconds, the bound is generous.
func TestClaimAfterStatisticsOfADispatchedTable(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	in := newInstance(t, pool, cfg)
	ctx := context.Background()
	produce := func(n int) {
		t.Helper()
		evs := make([]core.Event, n)
		for i := range evs {
			evs[i] = core.Event{AggregateID: uuid.NewString(), Type: "a.b", Payload: []byte(`{}`)}
		}
		if err := in.Produce(ctx, evs, true); err != nil {
			t.Fatal(err)
		}
	}
	produce(200)
	c, err := in.s.Claim(ctx, core.ClaimOptions{Limit: 1000})
	if err != nil {
		t.Fatal(err)
	}
	var ids []int64
	for _, e := range c.Events() {
		ids = append(ids, e.Seq)
	}
	if err := c.Complete(ctx, ids, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "ANALYZE "+pgx.Identifier{in.cfg.Schema, in.cfg.Table}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	produce(500)
	start := time.Now()
	c, err = in.s.Claim(ctx, core.ClaimOptions{Limit: 500})
	if err != nil {
		t.Fatal(err)
	}
	took := time.Since(start)
	defer c.Release(ctx)
	if n := len(c.Events()); n != 500 {
		t.Fatalf("claimed %d events, want 500", n)
	}
	if took > 3*time.Second {
		t.Fatalf("a claim of 500 took %v on a table whose statistics say nothing is pending", took)
	}
	t.Logf("claim of 500 took %v", took)
}
