package ordering_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/core"
)

// countingBroker accepts everything at once.
type countingBroker struct{ n atomic.Int64 }

func (b *countingBroker) Publish(context.Context, *core.Event) error { b.n.Add(1); return nil }
func (b *countingBroker) Close() error                               { return nil }

// claimStats is an Observer measuring claims.
type claimStats struct {
	claims, short, empty, claimed atomic.Int64
	claimNanos                    atomic.Int64
	batch                         int

	mu        sync.Mutex
	durations []time.Duration // of non-empty claims, in order
}

func (s *claimStats) Claimed(n int, d time.Duration) {
	if n > 0 {
		s.mu.Lock()
		s.durations = append(s.durations, d)
		s.mu.Unlock()
	}
	s.claims.Add(1)
	s.claimed.Add(int64(n))
	s.claimNanos.Add(int64(d))
	switch {
	case n == 0:
		s.empty.Add(1)
	case n < s.batch:
		s.short.Add(1)
	}
}
func (s *claimStats) Published(*core.Event, time.Duration, error) {}
func (s *claimStats) Completed(int, int, time.Duration)           {}
func (s *claimStats) Errored(string, error)                       {}
func (*claimStats) Rejected(*core.Event, error)                   {}

type drainCase struct {
	unordered  bool
	batch      int
	relays     int
	aggregates int
	index      string // "pending_id" (the schema's) or "created_at" (the article's)
}

func (c drainCase) String() string {
	mode := "ordered"
	if c.unordered {
		mode = "unordered"
	}
	return fmt.Sprintf("%s batch=%d relays=%d aggregates=%d index=%s", mode, c.batch, c.relays, c.aggregates, c.index)
}

// TestDrainThroughput measures how fast relays drain a backlog with a
// publisher that costs nothing: the figures in docs/design.md. It runs
// only when OUTBOX_DRAIN_EVENTS names the backlog size.
func TestDrainThroughput(t *testing.T) {
	if os.Getenv("OUTBOX_DRAIN_EVENTS") == "" {
		t.Skip("set OUTBOX_DRAIN_EVENTS (such as 200000) to measure drains")
	}
	events := sizeFromEnv(t, "OUTBOX_DRAIN_EVENTS", 0)
	aggs := sizeFromEnv(t, "OUTBOX_DRAIN_AGGREGATES", 1000)
	var cases []drainCase
	for _, unordered := range []bool{false, true} {
		for _, batch := range []int{500, 1000} {
			for _, relays := range []int{1, 4} {
				cases = append(cases, drainCase{unordered, batch, relays, aggs, "pending_id"})
			}
		}
	}
	if only := os.Getenv("OUTBOX_DRAIN_CASES"); only != "" {
		cases = nil
		for _, spec := range strings.Split(only, ";") {
			var c drainCase
			var mode string
			if _, err := fmt.Sscanf(spec, "%s %d %d %d %s", &mode, &c.batch, &c.relays, &c.aggregates, &c.index); err != nil {
				t.Fatalf("OUTBOX_DRAIN_CASES entry %q: want \"ordered|unordered batch relays aggregates index\": %v", spec, err)
			}
			c.unordered = mode == "unordered"
			cases = append(cases, c)
		}
	}
	// The machine is shared: each case runs several times and the best
	// run counts, the one least disturbed by other work.
	repeats := sizeFromEnv(t, "OUTBOX_DRAIN_REPEAT", 1)
	best := make([]float64, len(cases))
	for i, c := range cases {
		for range repeats {
			t.Run(strings.ReplaceAll(c.String(), " ", "_"), func(t *testing.T) {
				best[i] = max(best[i], drain(t, c, events))
			})
		}
	}
	for i, c := range cases {
		t.Logf("best of %d: %v: %.0f events/s", repeats, c, best[i])
	}
}

// drain runs one case and returns its events per second.
func drain(t *testing.T, c drainCase, events int) float64 {
	e := newEnv(t)
	ctx := context.Background()
	tbl := e.table()
	if c.index == "created_at" {
		idx := pgx.Identifier{e.cfg.Schema, e.cfg.Table + "_pending"}.Sanitize()
		if _, err := e.admin.Exec(ctx, `DROP INDEX `+idx+`; CREATE INDEX ON `+tbl+` (created_at) WHERE dispatched_at IS NULL AND parked_at IS NULL`); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := e.admin.Exec(ctx, `INSERT INTO `+tbl+` (event_id, aggregate_id, type, payload, created_at)
SELECT gen_random_uuid(), md5((g % $2)::text)::uuid, 'order.changed', '{"seq":1}',
       now() - interval '1 hour' + g * interval '1 microsecond'
FROM generate_series(1, $1) AS g`, events, c.aggregates); err != nil {
		t.Fatal(err)
	}
	if _, err := e.admin.Exec(ctx, `VACUUM ANALYZE `+tbl); err != nil {
		t.Fatal(err)
	}
	broker := &countingBroker{}
	stats := &claimStats{batch: c.batch}
	rs := make([]*replica, c.relays)
	start := time.Now()
	for i := range rs {
		rs[i] = &replica{env: e, name: fmt.Sprintf("%s-d%d", e.cfg.Schema, i), pub: broker, opts: core.Options{
			BatchSize: c.batch, Unordered: c.unordered, Observer: stats, PollInterval: pollInterval(t),
		}}
		rs[i].start()
	}
	waitFor(t, 30*time.Minute, "the drain", func() bool { return broker.n.Load() >= int64(events) })
	elapsed := time.Since(start)
	for _, r := range rs {
		r.stop()
	}
	if n := e.pending(ctx); n != 0 {
		t.Fatalf("%d events still pending after %d publishes", n, broker.n.Load())
	}
	claims := stats.claims.Load()
	// The first and last tenth of the claims show whether a claim's cost
	// grows as dispatched rows pile up.
	d := stats.durations
	tenth := max(len(d)/10, 1)
	mean := func(ds []time.Duration) float64 {
		var sum time.Duration
		for _, x := range ds {
			sum += x
		}
		return float64(sum) / float64(len(ds)) / 1e6
	}
	first, last := mean(d[:tenth]), mean(d[len(d)-tenth:])
	sorted := slices.Clone(d)
	slices.Sort(sorted)
	t.Logf("%v: %d events in %v = %.0f events/s; %d claims (%d short, %d empty), %.1f events per claim; "+
		"claim ms: mean %.2f, median %.2f, first tenth %.2f, last tenth %.2f",
		c, events, elapsed.Round(time.Millisecond), float64(events)/elapsed.Seconds(), claims, stats.short.Load(), stats.empty.Load(),
		float64(stats.claimed.Load())/float64(claims), float64(stats.claimNanos.Load())/float64(claims)/1e6,
		float64(sorted[len(sorted)/2])/1e6, first, last)
	return float64(events) / elapsed.Seconds()
}

// pollInterval is OUTBOX_DRAIN_POLL (such as 50ms), or the relay's default.
func pollInterval(t *testing.T) time.Duration {
	v := os.Getenv("OUTBOX_DRAIN_POLL")
	if v == "" {
		return 0
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		t.Fatalf("OUTBOX_DRAIN_POLL=%q: want a positive duration", v)
	}
	return d
}
