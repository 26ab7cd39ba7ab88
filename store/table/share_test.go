package table_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/table"
)

// sharing runs Share on a Store of its own until stopped.
type sharing struct {
	st   *table.Source
	stop context.CancelFunc
	done chan struct{}
	part atomic.Uint64 // the last part Share reported, as math.Float64bits
}

func startSharing(t *testing.T, pool *pgxpool.Pool, cfg store.Config) *sharing {
	t.Helper()
	st, err := table.New(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	sh := &sharing{st: st, stop: cancel, done: make(chan struct{})}
	go func() {
		defer close(sh.done)
		_ = st.Share(ctx, func(part float64) { sh.part.Store(math.Float64bits(part)) })
	}()
	t.Cleanup(sh.end)
	return sh
}

func (s *sharing) end() { s.stop(); <-s.done }

// waitSplit waits until the sharers own every partition between them,
// disjoint, in the given sizes (any order), each told its part, and returns
// how long it took.
func waitSplit(t *testing.T, within time.Duration, sizes []int, sharers ...*sharing) time.Duration {
	t.Helper()
	start := time.Now()
	var last string
	for time.Since(start) < within {
		seen := map[int]bool{}
		var got []int
		ok := true
		for _, s := range sharers {
			parts := s.st.Owned()
			got = append(got, len(parts))
			if math.Float64frombits(s.part.Load()) != float64(len(parts))/table.Partitions {
				ok = false
			}
			for _, p := range parts {
				if seen[p] {
					ok = false
				}
				seen[p] = true
			}
		}
		slices.Sort(got)
		want := slices.Sorted(slices.Values(sizes))
		if ok && len(seen) == table.Partitions && slices.Equal(got, want) {
			return time.Since(start)
		}
		last = fmt.Sprint(got, len(seen))
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("partitions not split %v within %s; last sizes and count owned: %s", sizes, within, last)
	return 0
}

// Relays split the partitions evenly and disjointly, a relay that joins
// gets its share, and the partitions of one that leaves, or whose session
// dies, go to the others within about a ShareInterval.
func TestSharersSplitPartitionsAndTakeOver(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	cfg.ShareInterval = 200 * time.Millisecond
	a := startSharing(t, pool, cfg)
	waitSplit(t, 5*time.Second, []int{32}, a)
	b := startSharing(t, pool, cfg)
	took := waitSplit(t, 5*time.Second, []int{16, 16}, a, b)
	t.Logf("a relay joining got its share in %s", took)
	c := startSharing(t, pool, cfg)
	waitSplit(t, 5*time.Second, []int{11, 11, 10}, a, b, c)

	c.end()
	took = waitSplit(t, 5*time.Second, []int{16, 16}, a, b)
	t.Logf("a relay leaving: its partitions taken in %s", took)

	// A session the server ends (a killed backend, a cut connection) takes
	// its partitions with it; its relay notices, reconnects and joins
	// again.
	admin := pgtest.NewPool(t)
	sessions := func() []int32 {
		rows, err := admin.Query(context.Background(),
			`SELECT pid FROM pg_stat_activity WHERE application_name = $1 ORDER BY pid`, "outbox share "+cfg.Schema+".events_outbox")
		if err != nil {
			t.Fatal(err)
		}
		pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
		if err != nil {
			t.Fatal(err)
		}
		return pids
	}
	before := sessions()
	if _, err := admin.Exec(context.Background(), `SELECT pg_terminate_backend(p) FROM unnest($1::int[]) p`, before); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	for {
		now := sessions()
		if len(now) == 2 && !slices.ContainsFunc(now, func(p int32) bool { return slices.Contains(before, p) }) {
			break
		}
		if time.Since(start) > 5*time.Second {
			t.Fatalf("sharing sessions %v after killing %v, want two new ones", now, before)
		}
		time.Sleep(10 * time.Millisecond)
	}
	took = waitSplit(t, 5*time.Second, []int{16, 16}, a, b)
	t.Logf("every sharing session killed: new sessions, split again %s later", took)
	if a.st.Owned() == nil {
		t.Fatal("a sharing store reports no sharing")
	}
	a.end()
	if got := a.st.Owned(); got != nil {
		t.Fatalf("a store no relay shares through owns %v, want nil (every partition)", got)
	}
}

// A relay that froze or lost its network keeps its partitions only until
// PostgreSQL ends its silent session (ShareTimeout, idle_session_timeout);
// then the others take them.
func TestSilentOwnerLosesItsPartitions(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	cfg.ShareInterval = 100 * time.Millisecond
	cfg.ShareTimeout = time.Second
	ctx := context.Background()
	a := startSharing(t, pool, cfg)
	waitSplit(t, 5*time.Second, []int{32}, a)
	// Freeze a's session as SIGSTOP would: the server side sees a session
	// that goes quiet while holding its locks.
	frozen, err := pgx.ConnectConfig(ctx, pool.Config().ConnConfig.Copy())
	if err != nil {
		t.Fatal(err)
	}
	defer frozen.Close(ctx)
	// Stand in for a's process: take over a's locks on a connection that
	// then says nothing, with the relay's timeout.
	a.end()
	member, part := table.ShareKeys(cfg)
	if _, err := frozen.Exec(ctx, fmt.Sprintf(`SET idle_session_timeout = %d;
SELECT pg_advisory_lock(%d, pg_backend_pid()); SELECT pg_advisory_lock(%d, p) FROM generate_series(0, %d) p`,
		cfg.ShareTimeout.Milliseconds(), member, part, table.Partitions-1)); err != nil {
		t.Fatal(err)
	}
	silentFrom := time.Now()
	b := startSharing(t, pool, cfg)
	time.Sleep(cfg.ShareTimeout / 2)
	if got := b.st.Owned(); len(got) != 0 {
		t.Fatalf("a relay took %v while their owner's session was alive", got)
	}
	waitSplit(t, 10*time.Second, []int{32}, b)
	took := time.Since(silentFrom)
	t.Logf("a silent owner's partitions taken %s after it went quiet (share_timeout %s)", took, cfg.ShareTimeout)
	if took < cfg.ShareTimeout {
		t.Fatalf("taken after %s, before the owner's session could have timed out", took)
	}
}

// Ownership only keeps relays apart; order never rests on it. Two relays
// that both claim a partition, as when one lost it with a claim still
// open, stay disjoint, and an event locked by one holds its aggregate's
// later events back in the other's claim.
func TestOrderHoldsWhenTwoRelaysClaimOnePartition(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	ctx := context.Background()
	a, err := table.New(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := table.New(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	in := newInstance(t, pool, cfg)
	for i := range 4 {
		in.insert(t, "agg", fmt.Sprintf(`{"n":%d}`, i))
	}
	ca, err := a.Claim(ctx, core.ClaimOptions{Limit: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer ca.Release(ctx)
	if len(ca.Events()) != 1 {
		t.Fatalf("first claim got %d events, want 1", len(ca.Events()))
	}
	cb, err := b.Claim(ctx, core.ClaimOptions{Limit: 10})
	if err != nil {
		t.Fatal(err)
	}
	defer cb.Release(ctx)
	if n := len(cb.Events()); n != 0 {
		t.Fatalf("second relay claimed %d events of an aggregate whose first event the other holds", n)
	}
	if err := ca.Complete(ctx, []int64{ca.Events()[0].Seq}, nil); err != nil {
		t.Fatal(err)
	}
	cb.Release(ctx)
	cb, err = b.Claim(ctx, core.ClaimOptions{Limit: 10})
	if err != nil {
		t.Fatal(err)
	}
	defer cb.Release(ctx)
	if n := len(cb.Events()); n != 3 {
		t.Fatalf("after the first completed, the second relay claimed %d events, want 3", n)
	}
}

// A relay that shares but owns no partition claims nothing, and claims
// its own partitions' events once it has them.
func TestClaimReadsOnlyOwnedPartitions(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	cfg.ShareInterval = 100 * time.Millisecond
	ctx := context.Background()
	in := newInstance(t, pool, cfg)
	for i := range 200 {
		in.insert(t, fmt.Sprintf("agg-%d", i), `{}`)
	}
	a := startSharing(t, pool, cfg)
	b := startSharing(t, pool, cfg)
	waitSplit(t, 5*time.Second, []int{16, 16}, a, b)
	var mu sync.Mutex
	partOf := map[string]int{}
	rows, err := pool.Query(ctx, "SELECT aggregate_id, hashtext(aggregate_id) & 31 FROM "+in.table())
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var agg string
		var p int
		if err := rows.Scan(&agg, &p); err != nil {
			t.Fatal(err)
		}
		partOf[agg] = p
	}
	total := 0
	for _, s := range []*sharing{a, b} {
		owned := s.st.Owned()
		c, err := s.st.Claim(ctx, core.ClaimOptions{Limit: 500})
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range c.Events() {
			mu.Lock()
			if !slices.Contains(owned, partOf[e.AggregateID]) {
				t.Errorf("claimed %s of partition %d, owning %v", e.AggregateID, partOf[e.AggregateID], owned)
			}
			mu.Unlock()
		}
		total += len(c.Events())
		defer c.Release(ctx)
	}
	if total != 200 {
		t.Fatalf("two relays claimed %d of 200 events between them", total)
	}
}

// insert writes an event with plain SQL, as any client may.
func (in *instance) insert(t *testing.T, agg, payload string) {
	t.Helper()
	if _, err := in.pool.Exec(context.Background(),
		"INSERT INTO "+in.table()+" (aggregate_id, type, payload) VALUES ($1, 't.x', $2)", agg, payload); err != nil {
		t.Fatal(err)
	}
}

// A relay whose sharing session the server refuses (an older server, a
// pooler) claims from every partition, in order through the row locks,
// rather than stopping.
func TestRefusedSharingClaimsEverything(t *testing.T) {
	_, cfg := pgtest.Schema(t)
	cfg.ShareInterval = 100 * time.Millisecond
	ctx := context.Background()
	pc, err := pgxpool.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	pc.ConnConfig.ValidateConnect = func(_ context.Context, c *pgconn.PgConn) error {
		if strings.HasPrefix(c.ParameterStatus("application_name"), "outbox share") {
			return errors.New("refused for the test")
		}
		return nil
	}
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	in := newInstance(t, pool, cfg)
	for i := range 50 {
		in.insert(t, fmt.Sprintf("agg-%d", i), `{}`)
	}
	sh := startSharing(t, pool, cfg)
	time.Sleep(300 * time.Millisecond)
	if got := sh.st.Owned(); got != nil {
		t.Fatalf("owned %v without a sharing session, want nil (every partition)", got)
	}
	c, err := sh.st.Claim(ctx, core.ClaimOptions{Limit: 100})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release(ctx)
	if n := len(c.Events()); n != 50 {
		t.Fatalf("claimed %d of 50 events without a sharing session", n)
	}
}
