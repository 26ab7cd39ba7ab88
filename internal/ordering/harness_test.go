package ordering_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/table"
)

// payload is what producers write: the aggregate's sequence number.
type payload struct {
	Seq int `json:"seq"`
}

// checker stands on the broker side. Per aggregate it flags a sequence
// number seen for the first time after a higher one (a reordering);
// repeats of a number already seen are duplicates, which at-least-once
// delivery allows, and are only counted.
type checker struct {
	mu         sync.Mutex
	seen       map[string]map[int]bool
	max        map[string]int
	uids       map[string]string // "aggregate/seq" -> event uid
	received   int
	duplicates int
	violations []string
}

func newChecker() *checker {
	return &checker{seen: map[string]map[int]bool{}, max: map[string]int{}, uids: map[string]string{}}
}

func (c *checker) record(e *core.Event) error {
	var p payload
	if err := json.Unmarshal(e.Payload, &p); err != nil {
		return fmt.Errorf("checker: event %d payload %s: %w", e.Seq, e.Payload, err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.received++
	s := c.seen[e.AggregateID]
	if s == nil {
		s = map[int]bool{}
		c.seen[e.AggregateID] = s
	}
	key := fmt.Sprintf("%s/%d", e.AggregateID, p.Seq)
	if s[p.Seq] {
		c.duplicates++
		if c.uids[key] != e.ID {
			c.violations = append(c.violations, fmt.Sprintf("aggregate %s seq %d: uid %s, earlier %s", e.AggregateID, p.Seq, e.ID, c.uids[key]))
		}
		return nil
	}
	if m := c.max[e.AggregateID]; p.Seq < m && len(c.violations) < 1000 {
		c.violations = append(c.violations, fmt.Sprintf("aggregate %s: seq %d arrived after %d", e.AggregateID, p.Seq, m))
	}
	s[p.Seq] = true
	c.uids[key] = e.ID
	c.max[e.AggregateID] = max(c.max[e.AggregateID], p.Seq)
	return nil
}

// missing counts the sequence numbers 1..want[agg] not yet seen.
func (c *checker) missing(want map[string]int) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for agg, last := range want {
		for seq := 1; seq <= last; seq++ {
			if !c.seen[agg][seq] {
				n++
			}
		}
	}
	return n
}

type checkerStats struct {
	received, duplicates int
	violations           []string
}

func (c *checker) stats() checkerStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return checkerStats{c.received, c.duplicates, append([]string(nil), c.violations...)}
}

// flakyBroker delivers to a checker after a random delay, sometimes slow,
// and fails some publishes transiently: before the broker has the message
// (broker down) or after (a lost acknowledgement, which causes a duplicate).
type flakyBroker struct {
	c           *checker
	failBefore  float64 // share of publishes failing before delivery
	failAfter   float64 // share failing after delivery
	slow        float64 // share taking slowDelay instead of up to fastDelay
	fastDelay   time.Duration
	slowDelay   time.Duration
	transients  atomic.Int64
	cancelled   atomic.Int64
	publishesOK atomic.Int64
}

func (b *flakyBroker) Publish(ctx context.Context, e *core.Event) error {
	d := time.Duration(rand.Int64N(int64(b.fastDelay) + 1))
	if rand.Float64() < b.slow {
		d = b.slowDelay
	}
	if d > 0 {
		t := time.NewTimer(d)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			b.cancelled.Add(1)
			return ctx.Err()
		}
	}
	r := rand.Float64()
	if r < b.failBefore {
		b.transients.Add(1)
		return errors.New("broker unavailable")
	}
	if err := b.c.record(e); err != nil {
		return core.Permanent(err)
	}
	if r < b.failBefore+b.failAfter {
		b.transients.Add(1)
		return errors.New("timed out waiting for the broker's acknowledgement")
	}
	b.publishesOK.Add(1)
	return nil
}

func (b *flakyBroker) Close() error { return nil }

// env is one test's database: a migrated schema and an admin pool.
type env struct {
	t     *testing.T
	url   string
	admin *pgxpool.Pool
	cfg   store.Config
}

func newEnv(t *testing.T) *env {
	t.Helper()
	pool, cfg := pgtest.Schema(t)
	cfg, err := cfg.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	return &env{t: t, url: pgtest.URL(t), admin: pool, cfg: cfg}
}

func (e *env) table() string { return pgx.Identifier{e.cfg.Schema, e.cfg.Table}.Sanitize() }

// pool opens a pool whose sessions carry name as application_name, so a
// test can find and terminate them.
func (e *env) pool(name string, maxConns int32) *pgxpool.Pool {
	e.t.Helper()
	cfg, err := pgxpool.ParseConfig(e.url)
	if err != nil {
		e.t.Fatal(err)
	}
	cfg.MaxConns = maxConns
	cfg.ConnConfig.RuntimeParams["application_name"] = name
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		e.t.Fatalf("open pool %s: %v", name, err)
	}
	return p
}

// pending counts events not yet dispatched (parked ones included).
func (e *env) pending(ctx context.Context) int {
	e.t.Helper()
	var n int
	if err := e.admin.QueryRow(ctx, `SELECT count(*) FROM `+e.table()+` WHERE dispatched_at IS NULL`).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

// replica is one relay process: its own pool, store and relay.
type replica struct {
	env  *env
	name string
	pub  core.Publisher
	opts core.Options
	gen  int

	pool  *pgxpool.Pool
	relay *core.Relay
}

func (r *replica) appName() string { return fmt.Sprintf("%s-g%d", r.name, r.gen) }

func (r *replica) start() {
	r.env.t.Helper()
	r.gen++
	r.pool = r.env.pool(r.appName(), 4)
	st, err := table.New(r.pool, r.env.cfg, nil)
	if err != nil {
		r.env.t.Fatal(err)
	}
	r.relay, err = core.New(st, r.pub, r.opts)
	if err != nil {
		r.env.t.Fatal(err)
	}
	if err := r.relay.Start(context.Background()); err != nil {
		r.env.t.Fatal(err)
	}
}

// kill stops the replica as a crash would: its database sessions are
// terminated first, so its open claim is rolled back and its row locks are
// freed while its lanes may still be publishing; only then is the process
// stopped, without waiting for in-flight publishes. It reports whether a
// claim was open at that moment.
func (r *replica) kill(ctx context.Context, zombie time.Duration) (claimOpen bool) {
	r.env.t.Helper()
	err := r.env.admin.QueryRow(ctx, `
WITH k AS (
    SELECT state, pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1
)
SELECT COALESCE(bool_or(state IN ('idle in transaction', 'active')), false) FROM k`, r.appName()).Scan(&claimOpen)
	if err != nil {
		r.env.t.Fatalf("terminate %s: %v", r.appName(), err)
	}
	if zombie > 0 {
		time.Sleep(zombie) // lanes run on without locks, as in a paused or partitioned process
	}
	expired, cancel := context.WithCancel(ctx)
	cancel()
	_ = r.relay.Stop(expired)
	r.pool.Close()
	r.relay = nil
	return claimOpen
}

// stop stops the replica gracefully.
func (r *replica) stop() {
	if r.relay == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := r.relay.Stop(ctx); err != nil {
		r.env.t.Errorf("stop %s: %v", r.name, err)
	}
	r.pool.Close()
	r.relay = nil
}

// workload is producers writing per-aggregate sequence numbers the way a
// service must for order to mean anything: the aggregate's row is locked
// and its counter bumped in the same transaction as the outbox write, so
// two transactions of one aggregate never commit out of id order.
type workload struct {
	env        *env
	aggregates []string
	writer     *outbox.Writer
	target     int64
	written    atomic.Int64
}

func newWorkload(e *env, aggregates int, events int) *workload {
	e.t.Helper()
	ctx := context.Background()
	agg := pgx.Identifier{e.cfg.Schema, "aggregates"}.Sanitize()
	if _, err := e.admin.Exec(ctx, `CREATE TABLE `+agg+` (id uuid PRIMARY KEY, seq integer NOT NULL DEFAULT 0)`); err != nil {
		e.t.Fatal(err)
	}
	w := &workload{env: e, target: int64(events)}
	for range aggregates {
		w.aggregates = append(w.aggregates, uuid.NewString())
	}
	if _, err := e.admin.Exec(ctx, `INSERT INTO `+agg+` (id) SELECT unnest($1::uuid[])`, w.aggregates); err != nil {
		e.t.Fatal(err)
	}
	var err error
	if w.writer, err = outbox.NewWriter(outbox.WriterOptions{Store: e.cfg}); err != nil {
		e.t.Fatal(err)
	}
	return w
}

// produce runs n producers until the target number of events is written.
func (w *workload) produce(ctx context.Context, n int) error {
	pool := w.env.pool(w.env.cfg.Schema+"-producers", int32(n))
	defer pool.Close()
	bump := `UPDATE ` + pgx.Identifier{w.env.cfg.Schema, "aggregates"}.Sanitize() + ` SET seq = seq + $2 WHERE id = $1 RETURNING seq`
	errs := make(chan error, n)
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				k := 1 + rand.IntN(3)
				if w.written.Add(int64(k))-int64(k) >= w.target {
					return
				}
				agg := w.aggregates[rand.IntN(len(w.aggregates))]
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					var last int
					if err := tx.QueryRow(ctx, bump, agg, k).Scan(&last); err != nil {
						return err
					}
					msgs := make([]outbox.Message, k)
					for i := range msgs {
						msgs[i] = outbox.Message{AggregateID: agg, Type: "order.changed", Payload: payload{Seq: last - k + 1 + i}}
					}
					return w.writer.Write(ctx, tx, msgs...)
				})
				if err != nil {
					errs <- fmt.Errorf("produce: %w", err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// want returns each aggregate's last sequence number.
func (w *workload) want(ctx context.Context) map[string]int {
	w.env.t.Helper()
	rows, err := w.env.admin.Query(ctx, `SELECT id::text, seq FROM `+pgx.Identifier{w.env.cfg.Schema, "aggregates"}.Sanitize())
	if err != nil {
		w.env.t.Fatal(err)
	}
	m, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (struct {
		id  string
		seq int
	}, error) {
		var v struct {
			id  string
			seq int
		}
		err := r.Scan(&v.id, &v.seq)
		return v, err
	})
	if err != nil {
		w.env.t.Fatal(err)
	}
	out := make(map[string]int, len(m))
	for _, v := range m {
		out[v.id] = v.seq
	}
	return out
}

// waitFor polls cond until it holds or timeout passes.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
