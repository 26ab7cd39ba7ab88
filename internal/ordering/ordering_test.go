package ordering_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store/table"
)

const (
	defaultEvents = 10000 // fits `make test`; the reliability suite sets more
	aggregates    = 300
	replicas      = 4
	producers     = 8
)

func sizeFromEnv(t *testing.T, name string, def int) int {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		t.Fatalf("%s=%q: want a positive number of events", name, v)
	}
	return n
}

// relayOptions keep batches small and timers short, so that a run of a
// few seconds has many claims racing and many retries.
func relayOptions(unordered bool) core.Options {
	return core.Options{
		BatchSize:       50,
		Lanes:           8,
		PollInterval:    20 * time.Millisecond,
		PublishTimeout:  2 * time.Second,
		ShutdownTimeout: 5 * time.Second,
		RetryBackoff:    core.Backoff{Min: 2 * time.Millisecond, Max: 40 * time.Millisecond},
		ErrorBackoff:    core.Backoff{Min: 2 * time.Millisecond, Max: 40 * time.Millisecond},
		Unordered:       unordered,
	}
}

type runResult struct {
	checker            checkerStats
	kills, claimsOpen  int
	transient, aborted int64
	elapsed            time.Duration
}

// runWorkload starts the replicas, runs the producers to completion while
// killing and restarting a random replica every few hundred milliseconds
// (when kill is set), and waits until the broker has every event.
func runWorkload(t *testing.T, events int, unordered, kill bool) runResult {
	e := newEnv(t)
	w := newWorkload(e, aggregates, events)
	c := newChecker()
	broker := &flakyBroker{
		c: c, failBefore: 0.01, failAfter: 0.01,
		slow: 0.02, fastDelay: 300 * time.Microsecond, slowDelay: 15 * time.Millisecond,
	}
	rs := make([]*replica, replicas)
	for i := range rs {
		rs[i] = &replica{env: e, name: fmt.Sprintf("%s-r%d", e.cfg.Schema, i), pub: broker, opts: relayOptions(unordered)}
		rs[i].start()
	}
	t.Cleanup(func() {
		for _, r := range rs {
			r.stop()
		}
	})

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	start := time.Now()
	produced := make(chan error, 1)
	go func() { produced <- w.produce(ctx, producers) }()

	// Kill until the producers are done, and at least minKills times.
	const minKills = 5
	var res runResult
	for done := false; !done || (kill && res.kills < minKills); {
		t0 := time.NewTimer(time.Duration(100+rand.IntN(200)) * time.Millisecond)
		select {
		case err := <-produced:
			t0.Stop()
			if err != nil {
				t.Fatal(err)
			}
			done = true
			produced = nil
		case <-t0.C:
		}
		if !kill {
			continue
		}
		r := rs[rand.IntN(len(rs))]
		if r.kill(ctx, time.Duration(rand.IntN(20))*time.Millisecond) {
			res.claimsOpen++
		}
		res.kills++
		time.Sleep(time.Duration(10+rand.IntN(70)) * time.Millisecond) // down for a while before the restart
		r.start()
	}

	want := w.want(ctx)
	total := 0
	for _, n := range want {
		total += n
	}
	waitFor(t, 90*time.Second, "the broker to have every event", func() bool {
		return c.missing(want) == 0 && e.pending(ctx) == 0
	})
	res.elapsed = time.Since(start)
	res.checker = c.stats()
	res.transient = broker.transients.Load()
	res.aborted = broker.cancelled.Load()
	t.Logf("%d events for %d aggregates in %v: received %d (%d duplicates), %d transient failures, %d publishes aborted by kills, %d kills (%d with a claim open)",
		total, len(want), res.elapsed.Round(time.Millisecond), res.checker.received, res.checker.duplicates,
		res.transient, res.aborted, res.kills, res.claimsOpen)
	return res
}

// Per-aggregate order holds with four replicas sharing the work while
// they are killed and restarted, publishes are slow and fail transiently.
func TestOrderHoldsAcrossReplicaKills(t *testing.T) {
	events := sizeFromEnv(t, "OUTBOX_ORDERING_EVENTS", defaultEvents)
	res := runWorkload(t, events, false, true)
	if v := res.checker.violations; len(v) > 0 {
		t.Fatalf("%d order violations, first: %v", len(v), v[:min(len(v), 10)])
	}
	// The run must have exercised what it claims to.
	if res.claimsOpen == 0 {
		t.Fatalf("only %d kills, %d with a claim open: the run did not test crashes", res.kills, res.claimsOpen)
	}
	if res.transient == 0 {
		t.Fatal("no transient failure happened: retries were not tested")
	}
}

// Negative control: the same workload in unordered mode, where nothing
// keeps an aggregate's events apart, does reorder, so the checker above
// can see a violation when there is one.
func TestUnorderedModeReorders(t *testing.T) {
	res := runWorkload(t, 3000, true, false)
	if len(res.checker.violations) == 0 {
		t.Fatal("unordered mode showed no reordering: the checker cannot see violations")
	}
	t.Logf("unordered mode: %d reorderings seen, e.g. %s", len(res.checker.violations), res.checker.violations[0])
}

// The gate, shown with two claims: while one claim holds an aggregate's
// first event, a second claim gets other aggregates' events but not that
// aggregate's second one. In unordered mode it gets it, and could publish
// it first.
func TestSecondClaimSkipsAnAggregateHeldByTheFirst(t *testing.T) {
	for _, unordered := range []bool{false, true} {
		t.Run(fmt.Sprintf("unordered=%v", unordered), func(t *testing.T) {
			e := newEnv(t)
			ctx := context.Background()
			st, err := table.New(e.admin, e.cfg, nil)
			if err != nil {
				t.Fatal(err)
			}
			x, y := uuid.NewString(), uuid.NewString()
			if _, err := e.admin.Exec(ctx, `INSERT INTO `+e.table()+` (event_id, aggregate_id, type, payload)
				VALUES (gen_random_uuid(), $1, 'x.1', '{}'), (gen_random_uuid(), $1, 'x.2', '{}'), (gen_random_uuid(), $2, 'y.1', '{}')`, x, y); err != nil {
				t.Fatal(err)
			}
			first, err := st.Claim(ctx, core.ClaimOptions{Limit: 1, Unordered: unordered})
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = first.Release(ctx) }()
			second, err := st.Claim(ctx, core.ClaimOptions{Limit: 10, Unordered: unordered})
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = second.Release(ctx) }()
			var got []string
			for _, ev := range second.Events() {
				got = append(got, ev.Type)
			}
			want := "[y.1]"
			if unordered {
				want = "[x.2 y.1]"
			}
			if fmt.Sprint(got) != want {
				t.Fatalf("second claim got %v, want %s", got, want)
			}
		})
	}
}
