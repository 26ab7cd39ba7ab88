package admin_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
	"github.com/outboxhq/outbox/dedupe"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/admin"
	"github.com/outboxhq/outbox/store/table"
)

// opsRow is an outbox row in a given state; ages are relative to now().
type opsRow struct {
	typ, agg      string
	createdAgo    time.Duration
	dispatchedAgo time.Duration // 0: not dispatched
	held, parked  bool
	retryIn       time.Duration // > 0: backing off
}

func opsInsert(t *testing.T, pool *pgxpool.Pool, cfg store.Config, rows ...opsRow) []int64 {
	t.Helper()
	ids := make([]int64, 0, len(rows))
	table := pgx.Identifier{cfg.Schema, "events_outbox"}.Sanitize()
	for _, r := range rows {
		if r.agg == "" {
			r.agg = uuid.NewString()
		}
		if r.typ == "" {
			r.typ = "order.placed"
		}
		var retry any
		switch {
		case r.held:
			retry = "infinity"
		case r.retryIn > 0:
			retry = time.Now().Add(r.retryIn).UTC().Format(time.RFC3339Nano)
		}
		var id int64
		err := pool.QueryRow(context.Background(), `INSERT INTO `+table+`
 (event_id, aggregate_id, type, payload, created_at, dispatched_at, retry_at, parked_at, attempts)
VALUES ($1, $2, $3, '{"n":1}', now() - make_interval(secs => $4),
 CASE WHEN $5::float8 > 0 THEN now() - make_interval(secs => $5) END,
 $6::timestamptz, CASE WHEN $7 THEN now() END, CASE WHEN $6::timestamptz IS NULL THEN 0 ELSE 1 END)
RETURNING seq`,
			uuid.NewString(), r.agg, r.typ, r.createdAgo.Seconds(), r.dispatchedAgo.Seconds(), retry, r.parked).Scan(&id)
		if err != nil {
			t.Fatalf("insert %+v: %v", r, err)
		}
		ids = append(ids, id)
	}
	return ids
}

func opsStore(t *testing.T) (*pgxpool.Pool, store.Config, *admin.Admin) {
	t.Helper()
	pool, cfg := pgtest.Schema(t)
	st, err := admin.New(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	return pool, cfg, st
}

func TestStatusCounts(t *testing.T) {
	pool, cfg, st := opsStore(t)
	opsInsert(t, pool, cfg,
		opsRow{createdAgo: time.Second},                                  // pending
		opsRow{createdAgo: time.Hour},                                    // pending, stuck, oldest
		opsRow{createdAgo: time.Second, held: true},                      // held: stuck whatever its age
		opsRow{createdAgo: time.Second, retryIn: time.Minute},            // retrying
		opsRow{createdAgo: 2 * time.Hour, parked: true},                  // parked: not pending
		opsRow{createdAgo: time.Minute, dispatchedAgo: 10 * time.Second}, // dispatched in the last minute
		opsRow{createdAgo: time.Hour, dispatchedAgo: 5 * time.Minute},
	)
	s, err := st.Status(context.Background(), admin.StatusOptions{StuckAfter: 10 * time.Minute, RelayApplication: "outbox-ops-test"})
	if err != nil {
		t.Fatal(err)
	}
	type counts struct{ pending, retrying, held, parked, stuck, lastMinute int64 }
	want := counts{pending: 4, retrying: 1, held: 1, parked: 1, stuck: 2, lastMinute: 1}
	got := counts{s.Pending, s.Retrying, s.Held, s.Parked, s.Stuck, s.DispatchedLastMinute}
	if got != want {
		t.Errorf("status counts = %+v, want %+v", got, want)
	}
	if s.OldestPendingAge < time.Hour || s.OldestPendingAge > time.Hour+time.Minute {
		t.Errorf("oldest pending age = %v, want about 1h", s.OldestPendingAge)
	}
	if len(s.Replicas) != 0 {
		t.Errorf("replicas = %+v, want none for an application nobody uses", s.Replicas)
	}

	_, _, est := opsStore(t)
	s, err = est.Status(context.Background(), admin.StatusOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if s.Pending != 0 || !s.OldestPending.IsZero() || s.OldestPendingAge != 0 {
		t.Errorf("empty outbox status = %+v", s)
	}
}

func TestStatusListsRelaySessions(t *testing.T) {
	pool, cfg, _ := opsStore(t)
	pc := pool.Config().Copy()
	pc.ConnConfig.RuntimeParams["application_name"] = "outbox-relay-test"
	relayPool, err := pgxpool.NewWithConfig(context.Background(), pc)
	if err != nil {
		t.Fatal(err)
	}
	defer relayPool.Close()
	tx, err := relayPool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	if _, err := tx.Exec(context.Background(), "SELECT 1"); err != nil {
		t.Fatal(err)
	}
	st, _ := admin.New(pool, cfg, nil)
	s, err := st.Status(context.Background(), admin.StatusOptions{RelayApplication: "outbox-relay-test"})
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Replicas) != 1 || s.Replicas[0].InClaim != 1 || s.Replicas[0].OldestClaim.IsZero() ||
		s.Replicas[0].LastQuery.Before(s.Replicas[0].OldestClaim) {
		t.Errorf("replicas = %+v, want one with an open transaction and its last statement in it", s.Replicas)
	}
}

func opsCount(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) int64 {
	t.Helper()
	var n int64
	if err := pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

func TestCleanupDeletesOnlyOldDispatched(t *testing.T) {
	pool, cfg, st := opsStore(t)
	day := 24 * time.Hour
	old := opsInsert(t, pool, cfg,
		opsRow{createdAgo: 9 * day, dispatchedAgo: 8 * day},
		opsRow{createdAgo: 9 * day, dispatchedAgo: 8 * day},
		opsRow{createdAgo: 30 * day, dispatchedAgo: 7*day + time.Hour},
	)
	keep := opsInsert(t, pool, cfg,
		opsRow{createdAgo: 8 * day, dispatchedAgo: 6 * day}, // created long ago, dispatched recently
		opsRow{createdAgo: time.Hour, dispatchedAgo: time.Minute},
		opsRow{createdAgo: 30 * day},               // pending
		opsRow{createdAgo: 30 * day, held: true},   // held for an operator
		opsRow{createdAgo: 30 * day, parked: true}, // parked
	)
	processed := pgx.Identifier{cfg.Schema, "processed_events"}.Sanitize()
	if _, err := pool.Exec(context.Background(), `INSERT INTO `+processed+` (consumer, event_id, processed_at) VALUES
 ('a', 'e1', now() - interval '15 days'), ('b', 'e1', now() - interval '20 days'),
 ('a', 'e2', now() - interval '13 days'), ('a', 'e3', now())`); err != nil {
		t.Fatal(err)
	}
	table := pgx.Identifier{cfg.Schema, "events_outbox"}.Sanitize()

	dry, err := st.Cleanup(context.Background(), admin.CleanupOptions{DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	if dry.Outbox != 3 || dry.Processed != 2 {
		t.Errorf("dry run counted %d outbox, %d processed; want 3 and 2", dry.Outbox, dry.Processed)
	}
	if n := opsCount(t, pool, "SELECT count(*) FROM "+table); n != 8 {
		t.Fatalf("dry run deleted rows: %d left of 8", n)
	}

	var progress []admin.CleanupProgress
	res, err := st.Cleanup(context.Background(), admin.CleanupOptions{BatchSize: 2,
		Progress: func(p admin.CleanupProgress) { progress = append(progress, p) }})
	if err != nil {
		t.Fatal(err)
	}
	if res.Outbox != 3 || res.Processed != 2 {
		t.Errorf("deleted %d outbox, %d processed; want 3 and 2", res.Outbox, res.Processed)
	}
	// 3 rows in batches of 2 take two deletes; 2 rows take a full batch
	// and an empty one.
	if res.Batches != 4 || len(progress) != 4 {
		t.Errorf("batches = %d, progress calls = %d; want 4 each", res.Batches, len(progress))
	}
	if n := opsCount(t, pool, "SELECT count(*) FROM "+table+" WHERE seq = ANY($1)", old); n != 0 {
		t.Errorf("%d old dispatched events survived", n)
	}
	if n := opsCount(t, pool, "SELECT count(*) FROM "+table+" WHERE seq = ANY($1)", keep); n != int64(len(keep)) {
		t.Errorf("%d of %d events that must stay were deleted", int64(len(keep))-n, len(keep))
	}
	if n := opsCount(t, pool, "SELECT count(*) FROM "+processed+" WHERE event_id IN ('e2', 'e3')"); n != 2 {
		t.Errorf("recent processed records deleted: %d of 2 left", n)
	}
}

func TestCleanupOneCleanerAtATime(t *testing.T) {
	pool, cfg, st := opsStore(t)
	opsInsert(t, pool, cfg, opsRow{createdAgo: 9 * 24 * time.Hour, dispatchedAgo: 8 * 24 * time.Hour})
	other, _ := admin.New(pool, cfg, nil) // a second replica's

	inside, release := make(chan struct{}), make(chan struct{})
	var first admin.CleanupResult
	var firstErr error
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		var once sync.Once
		first, firstErr = st.Cleanup(context.Background(), admin.CleanupOptions{Progress: func(admin.CleanupProgress) {
			once.Do(func() { close(inside); <-release })
		}})
	}()
	<-inside
	_, err := other.Cleanup(context.Background(), admin.CleanupOptions{})
	if !errors.Is(err, admin.ErrCleanupBusy) {
		t.Errorf("second cleaner: err = %v, want ErrCleanupBusy", err)
	}
	close(release)
	wg.Wait()
	if firstErr != nil || first.Outbox != 1 {
		t.Fatalf("first cleaner: %+v, %v", first, firstErr)
	}
	// The lock is released with the run.
	if _, err := other.Cleanup(context.Background(), admin.CleanupOptions{}); err != nil {
		t.Errorf("cleanup after the first finished: %v", err)
	}
}

func TestCleanupRejectsBadOptions(t *testing.T) {
	_, _, st := opsStore(t)
	for _, o := range []admin.CleanupOptions{{Dispatched: -1}, {Processed: -time.Hour}, {BatchSize: -5}, {Pause: -1}} {
		if _, err := st.Cleanup(context.Background(), o); err == nil {
			t.Errorf("Cleanup(%+v) accepted bad options", o)
		}
	}
}

// dedupeConsumer is a publisher that hands each event straight to a
// deduplicating consumer, as a broker would.
type dedupeConsumer struct {
	d         *dedupe.Deduper[pgx.Tx]
	delivered atomic.Int64
	mu        sync.Mutex
	effects   map[string]int // event uid -> handler runs that committed
}

func (c *dedupeConsumer) Publish(ctx context.Context, e *core.Event) error {
	c.delivered.Add(1)
	_, err := c.d.Process(ctx, e.ID, func(ctx context.Context, tx pgx.Tx) error {
		c.mu.Lock()
		c.effects[e.ID]++
		c.mu.Unlock()
		return nil
	})
	return err
}

func (c *dedupeConsumer) Close() error { return nil }

// opsRelayUntil runs a relay over cfg's outbox until cond holds.
func opsRelayUntil(t *testing.T, pool *pgxpool.Pool, cfg store.Config, pub core.Publisher, cond func() bool) {
	t.Helper()
	src, err := table.New(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	r, err := core.New(src, pub, core.Options{PollInterval: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := r.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer r.Stop(context.Background())
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("relay did not reach the expected state in 20s")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestReplayIsDedupedByConsumer(t *testing.T) {
	pool, cfg, st := opsStore(t)
	d, err := dedupe.New(pool, dedupe.Options{Consumer: "billing", Store: cfg})
	if err != nil {
		t.Fatal(err)
	}
	c := &dedupeConsumer{d: d, effects: map[string]int{}}
	agg := uuid.NewString()
	opsInsert(t, pool, cfg,
		opsRow{typ: "order.placed", agg: agg}, opsRow{typ: "order.paid", agg: agg},
		opsRow{typ: "order.placed"}, opsRow{typ: "order.placed"}, opsRow{typ: "invoice.sent"})
	ctx := context.Background()
	pending := func() bool {
		s, err := st.Status(ctx, admin.StatusOptions{})
		return err == nil && s.Pending == 0
	}
	opsRelayUntil(t, pool, cfg, c, pending)
	if c.delivered.Load() != 5 {
		t.Fatalf("first run delivered %d, want 5", c.delivered.Load())
	}

	n, err := st.Replay(ctx, admin.Selector{Type: "order.placed"}, admin.ReplayOptions{DryRun: true})
	if err != nil || n != 3 {
		t.Fatalf("dry-run replay = %d, %v; want 3", n, err)
	}
	if !pending() {
		t.Fatal("dry run made events pending")
	}
	var seen []int64
	n, err = st.Replay(ctx, admin.Selector{Type: "order.placed"},
		admin.ReplayOptions{BatchSize: 2, Progress: func(total int64) { seen = append(seen, total) }})
	if err != nil || n != 3 {
		t.Fatalf("replay = %d, %v; want 3", n, err)
	}
	if len(seen) != 2 || seen[1] != 3 {
		t.Errorf("progress = %v, want two batches ending at 3", seen)
	}
	opsRelayUntil(t, pool, cfg, c, pending)
	if c.delivered.Load() != 8 {
		t.Errorf("after replay delivered %d, want 5 + 3", c.delivered.Load())
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.effects) != 5 {
		t.Errorf("consumer saw %d distinct events, want 5: replays must keep their uid", len(c.effects))
	}
	for uid, runs := range c.effects {
		if runs != 1 {
			t.Errorf("event %s took effect %d times, want once", uid, runs)
		}
	}
}

func TestReplaySelectors(t *testing.T) {
	pool, cfg, st := opsStore(t)
	agg := uuid.NewString()
	ids := opsInsert(t, pool, cfg,
		opsRow{agg: agg, createdAgo: 3 * time.Hour, dispatchedAgo: time.Hour},
		opsRow{agg: agg, createdAgo: 2 * time.Hour, dispatchedAgo: time.Hour},
		opsRow{createdAgo: 30 * time.Minute, dispatchedAgo: time.Minute},
		opsRow{agg: agg, createdAgo: time.Minute}, // pending: not replayed
		opsRow{agg: agg, createdAgo: time.Hour, parked: true},
	)
	ctx := context.Background()
	now := time.Now()
	cases := []struct {
		name string
		sel  admin.Selector
		want int64
	}{
		{"id range", admin.Selector{FromSeq: ids[1], ToSeq: ids[4]}, 2},
		{"from id", admin.Selector{FromSeq: ids[2]}, 1},
		{"aggregate", admin.Selector{AggregateID: agg}, 2},
		{"created window", admin.Selector{CreatedAfter: now.Add(-150 * time.Minute), CreatedBefore: now.Add(-10 * time.Minute)}, 2},
		{"aggregate and window", admin.Selector{AggregateID: agg, CreatedBefore: now.Add(-150 * time.Minute)}, 1},
		{"no match", admin.Selector{Type: "nothing.here"}, 0},
	}
	for _, c := range cases {
		n, err := st.Replay(ctx, c.sel, admin.ReplayOptions{DryRun: true})
		if err != nil || n != c.want {
			t.Errorf("%s (%s): %d, %v; want %d", c.name, c.sel, n, err, c.want)
		}
	}
	for _, bad := range []admin.Selector{{}, {FromSeq: 5, ToSeq: 2}, {AggregateID: strings.Repeat("k", event.MaxKeyBytes+1)}, {FromSeq: -1},
		{CreatedAfter: now, CreatedBefore: now.Add(-time.Hour)}} {
		if _, err := st.Replay(ctx, bad, admin.ReplayOptions{}); err == nil {
			t.Errorf("Replay(%+v) accepted a bad selector", bad)
		}
	}
	n, err := st.Replay(ctx, admin.Selector{AggregateID: agg}, admin.ReplayOptions{})
	if err != nil || n != 2 {
		t.Fatalf("replay aggregate = %d, %v", n, err)
	}
	s, _ := st.Status(ctx, admin.StatusOptions{})
	if s.Pending != 3 || s.Parked != 1 {
		t.Errorf("after replay: pending %d, parked %d; want 3 and 1", s.Pending, s.Parked)
	}
}

// TestRetentionAtScale measures cleanup on a large table and the claim
// latency of a relay meanwhile. It runs only when OUTBOX_SCALE_ROWS is
// set (for example 3000000); docs/operations.md reports its figures.
func TestRetentionAtScale(t *testing.T) {
	rows, _ := strconv.Atoi(os.Getenv("OUTBOX_SCALE_ROWS"))
	if rows <= 0 {
		t.Skip("set OUTBOX_SCALE_ROWS to run")
	}
	pool, cfg, st := opsStore(t)
	src, err := table.New(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	table := pgx.Identifier{cfg.Schema, "events_outbox"}.Sanitize()
	start := time.Now()
	// Dispatched events spread evenly over the last 14 days, so about half
	// are past the 7-day window, then 20,000 pending ones.
	if _, err := pool.Exec(ctx, `INSERT INTO `+table+` (event_id, aggregate_id, type, payload, created_at, dispatched_at)
SELECT gen_random_uuid(), gen_random_uuid(), 'order.placed', '{"order_id":"x","amount_cents":1234}',
       now() - make_interval(secs => ($1 - i) * 1209600.0 / $1),
       now() - make_interval(secs => ($1 - i) * 1209600.0 / $1) + interval '50 milliseconds'
FROM generate_series(1, $1) AS i`, rows); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO `+table+` (event_id, aggregate_id, type, payload)
SELECT gen_random_uuid(), gen_random_uuid(), 'order.placed', '{}' FROM generate_series(1, 20000)`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "VACUUM ANALYZE "+table); err != nil {
		t.Fatal(err)
	}
	t.Logf("filled %d rows in %s", rows+20000, time.Since(start).Round(time.Second))

	// claims claims 100 events and releases them, as often as it can,
	// until stop; it returns each claim's latency.
	claims := func(stop <-chan struct{}) []time.Duration {
		var lat []time.Duration
		for {
			select {
			case <-stop:
				return lat
			default:
			}
			t0 := time.Now()
			c, err := src.Claim(ctx, core.ClaimOptions{Limit: 100})
			if err != nil {
				t.Error(err)
				return lat
			}
			lat = append(lat, time.Since(t0))
			_ = c.Release(ctx)
		}
	}
	measure := func(d time.Duration) []time.Duration {
		stop := make(chan struct{})
		time.AfterFunc(d, func() { close(stop) })
		return claims(stop)
	}
	base := measure(10 * time.Second)
	t.Logf("claim latency, idle: %s", summary(base))

	stop := make(chan struct{})
	during := make(chan []time.Duration)
	go func() { during <- claims(stop) }()
	res, err := st.Cleanup(ctx, admin.CleanupOptions{})
	close(stop)
	lat := <-during
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("cleanup deleted %d rows in %d batches in %s (%.0f rows/s)", res.Outbox, res.Batches,
		res.Elapsed.Round(time.Millisecond), float64(res.Outbox)/res.Elapsed.Seconds())
	t.Logf("claim latency, during cleanup: %s", summary(lat))
	after := measure(10 * time.Second)
	t.Logf("claim latency, after cleanup: %s", summary(after))

	// The same delete batch without the retention index, for comparison.
	if _, err := pool.Exec(ctx, `INSERT INTO `+table+` (event_id, aggregate_id, type, payload, created_at, dispatched_at)
SELECT gen_random_uuid(), gen_random_uuid(), 't', '{}', now() - interval '10 days', now() - interval '10 days'
FROM generate_series(1, 50000)`); err != nil {
		t.Fatal(err)
	}
	var idx string
	if err := pool.QueryRow(ctx, `SELECT indexname FROM pg_indexes WHERE schemaname = $1 AND indexdef LIKE '%(dispatched_at)%'`, cfg.Schema).Scan(&idx); err != nil {
		t.Fatal(err)
	}
	for _, withIndex := range []bool{true, false} {
		if !withIndex {
			if _, err := pool.Exec(ctx, "DROP INDEX "+pgx.Identifier{cfg.Schema, idx}.Sanitize()); err != nil {
				t.Fatal(err)
			}
		}
		t0 := time.Now()
		r, err := st.Cleanup(ctx, admin.CleanupOptions{BatchSize: 5000, Progress: func(p admin.CleanupProgress) {}})
		if err != nil {
			t.Fatal(err)
		}
		_ = r
		t.Logf("index=%v: one cleanup run of %d rows took %s", withIndex, r.Outbox, time.Since(t0).Round(time.Millisecond))
		if withIndex {
			if _, err := pool.Exec(ctx, `INSERT INTO `+table+` (event_id, aggregate_id, type, payload, created_at, dispatched_at)
SELECT gen_random_uuid(), gen_random_uuid(), 't', '{}', now() - interval '10 days', now() - interval '10 days'
FROM generate_series(1, 50000)`); err != nil {
				t.Fatal(err)
			}
		}
	}
}

func summary(lat []time.Duration) string {
	if len(lat) == 0 {
		return "no samples"
	}
	s := slices.Clone(lat)
	slices.Sort(s)
	q := func(p float64) time.Duration {
		return s[min(int(p*float64(len(s))), len(s)-1)].Round(10 * time.Microsecond)
	}
	return fmt.Sprintf("n=%d p50=%s p90=%s p99=%s max=%s", len(s), q(.5), q(.9), q(.99), s[len(s)-1].Round(10*time.Microsecond))
}

// TestRetentionIndexCost measures what the retention index of migration
// 0002 costs producers (inserts) and the relay (marking dispatched). It
// runs only when OUTBOX_SCALE_ROWS is set.
func TestRetentionIndexCost(t *testing.T) {
	if os.Getenv("OUTBOX_SCALE_ROWS") == "" {
		t.Skip("set OUTBOX_SCALE_ROWS to run")
	}
	ctx := context.Background()
	run := func(withIndex bool) (insert, mark time.Duration) {
		pool, cfg, _ := opsStore(t)
		table := pgx.Identifier{cfg.Schema, "events_outbox"}.Sanitize()
		if !withIndex {
			var idx string
			if err := pool.QueryRow(ctx, `SELECT indexname FROM pg_indexes WHERE schemaname = $1 AND indexdef LIKE '%(dispatched_at)%'`, cfg.Schema).Scan(&idx); err != nil {
				t.Fatal(err)
			}
			if _, err := pool.Exec(ctx, "DROP INDEX "+pgx.Identifier{cfg.Schema, idx}.Sanitize()); err != nil {
				t.Fatal(err)
			}
		}
		const batches, size = 300, 100
		for range batches {
			t0 := time.Now()
			var ids []int64
			rows, err := pool.Query(ctx, `INSERT INTO `+table+` (event_id, aggregate_id, type, payload)
SELECT gen_random_uuid(), gen_random_uuid(), 'order.placed', '{"order_id":"x"}' FROM generate_series(1, $1) RETURNING seq`, size)
			if err != nil {
				t.Fatal(err)
			}
			for rows.Next() {
				var id int64
				_ = rows.Scan(&id)
				ids = append(ids, id)
			}
			rows.Close()
			insert += time.Since(t0)
			t0 = time.Now()
			if _, err := pool.Exec(ctx, `UPDATE `+table+` SET dispatched_at = now(), retry_at = NULL WHERE seq = ANY($1)`, ids); err != nil {
				t.Fatal(err)
			}
			mark += time.Since(t0)
		}
		return insert / batches, mark / batches
	}
	for round := range 3 {
		for _, with := range []bool{false, true} {
			ins, mark := run(with)
			t.Logf("round %d index=%v: insert of 100 events %s, mark of 100 events %s", round, with,
				ins.Round(time.Microsecond), mark.Round(time.Microsecond))
		}
	}
}

// RunRetention cleans up on its interval and returns when ctx ends.
func TestRunRetention(t *testing.T) {
	pool, cfg, st := opsStore(t)
	day := 24 * time.Hour
	opsInsert(t, pool, cfg, opsRow{createdAgo: 9 * day, dispatchedAgo: 8 * day}, opsRow{createdAgo: 30 * day})
	table := pgx.Identifier{cfg.Schema, "events_outbox"}.Sanitize()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); st.RunRetention(ctx, admin.CleanupOptions{}, 20*time.Millisecond) }()
	deadline := time.Now().Add(10 * time.Second)
	for opsCount(t, pool, "SELECT count(*) FROM "+table) != 1 {
		if time.Now().After(deadline) {
			t.Fatal("retention did not delete the old dispatched event")
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("RunRetention did not return after cancel")
	}
}
