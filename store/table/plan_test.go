package table_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/pgtest"
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
	in.produceSpread(ctx, t, 200)
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
	if _, err := pool.Exec(ctx, "ANALYZE "+in.table()); err != nil {
		t.Fatal(err)
	}
	in.produceSpread(ctx, t, 500)
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

// A plan made while the table was small reads it whole, and statistics of
// dispatched rows say nothing is pending. The store plans its claims once
// per session, so such a plan would last until the next ANALYZE: each
// claim and each mark read the whole table, or a whole partial index to
// look up a few hundred seqs. The plans of the claim and the mark the
// store sends are caught here as PostgreSQL logs them (auto_explain, whose
// lines reach the client as notices), made on a table of five events and
// used on one of twenty thousand.
func TestClaimPlansOutliveTheTableTheyWereMadeFor(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	in := newInstance(t, pool, cfg)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, "LOAD 'auto_explain'"); err != nil {
		t.Skipf("auto_explain cannot be loaded by this role: %v", err)
	}

	var mu sync.Mutex
	var plans []string
	s := storeOver(t, pool, cfg, func(pc *pgxpool.Config) {
		pc.MaxConns = 1 // one session, so the second round uses the plans of the first
		pc.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
			_, err := c.Exec(ctx, "LOAD 'auto_explain'; SET auto_explain.log_min_duration = 0; SET client_min_messages = log")
			return err
		}
		pc.ConnConfig.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
			mu.Lock()
			defer mu.Unlock()
			plans = append(plans, n.Message)
		}
	})
	round := func(n int) {
		t.Helper()
		for _, unordered := range []bool{false, true} {
			c, err := s.Claim(ctx, core.ClaimOptions{Limit: n, Unordered: unordered})
			if err != nil {
				t.Fatal(err)
			}
			var ids []int64
			for _, e := range c.Events() {
				ids = append(ids, e.Seq)
			}
			if len(ids) != n {
				_ = c.Release(ctx)
				t.Fatalf("claimed %d events, want %d", len(ids), n)
			}
			if err := c.Complete(ctx, ids, nil); err != nil {
				t.Fatal(err)
			}
		}
	}
	in.produceSpread(ctx, t, 10)
	round(5)
	in.produceSpread(ctx, t, 20000)
	if _, err := pool.Exec(ctx, "UPDATE "+in.table()+" SET dispatched_at = now() WHERE seq <= (SELECT max(seq) - 300 FROM "+in.table()+")"); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	plans = nil
	mu.Unlock()
	round(100)

	mu.Lock()
	defer mu.Unlock()
	var claims, marks int
	for _, p := range plans {
		switch {
		case strings.Contains(p, "FOR UPDATE SKIP LOCKED"):
			claims++
		case strings.Contains(p, "SET dispatched_at = now()"):
			marks++
		default:
			continue
		}
		if strings.Contains(p, "Seq Scan on "+in.cfg.Table) {
			t.Errorf("a plan reads the whole table:\n%s", p)
		}
		if strings.Contains(p, "seq = ANY") && !strings.Contains(p, "on "+in.cfg.Table+"_pkey") && !strings.Contains(p, "using "+in.cfg.Table+"_pkey") {
			t.Errorf("a plan looks seqs up without the primary key:\n%s", p)
		}
	}
	if claims != 2 || marks != 2 {
		t.Fatalf("caught the plans of %d claims and %d marks, want 2 of each", claims, marks)
	}
}

// produceSpread commits n events, each of an aggregate of its own.
func (in *instance) produceSpread(ctx context.Context, t *testing.T, n int) {
	t.Helper()
	evs := make([]core.Event, n)
	for i := range evs {
		evs[i] = core.Event{AggregateID: uuid.NewString(), Type: "a.b", Payload: []byte(`{}`)}
	}
	if err := in.Produce(ctx, evs, true); err != nil {
		t.Fatal(err)
	}
}
