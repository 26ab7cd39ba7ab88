package logrelay_test

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/url"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/brokers/brokertest"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/admin"
	"github.com/outboxhq/outbox/store/logrelay"
	"github.com/outboxhq/outbox/store/migrate"
	"github.com/outboxhq/outbox/store/table"
)

// env is one test's outbox (a schema of its own), its slot and writers.
type env struct {
	t    *testing.T
	pool *pgxpool.Pool
	cfg  store.Config
	slot logrelay.Slot
	rows *outbox.Writer
	log  *outbox.LogWriter
}

func newEnv(t *testing.T) *env {
	t.Helper()
	pgtest.Logical(t)
	pool, cfg := pgtest.Schema(t)
	e := outboxOn(t, pool, cfg)
	// Registered before the schema's cleanup runs (cleanups run last
	// first), so the slot goes before its table; a slot left behind
	// would hold the shared server's WAL.
	t.Cleanup(func() { e.dropSlot() })
	return e
}

// outboxOn is an env for the migrated outbox cfg names on pool: its slot
// resolved, not created, and its writers.
func outboxOn(t *testing.T, pool *pgxpool.Pool, cfg store.Config) *env {
	t.Helper()
	cfg, err := cfg.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	slot, err := logrelay.Slot{}.Resolve(context.Background(), pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	e := &env{t: t, pool: pool, cfg: cfg, slot: slot}
	if e.rows, err = outbox.NewWriter(outbox.WriterOptions{Store: cfg}); err != nil {
		t.Fatal(err)
	}
	if e.log, err = outbox.NewLogWriter(outbox.WriterOptions{Store: cfg}); err != nil {
		t.Fatal(err)
	}
	return e
}

// privateOutbox migrates an outbox in schema on pool, a server of the
// test's own, and makes its slot.
func privateOutbox(t *testing.T, pool *pgxpool.Pool, schema string) *env {
	t.Helper()
	cfg := store.Config{Schema: schema}
	if _, err := migrate.Migrate(context.Background(), pool, cfg); err != nil {
		t.Fatal(err)
	}
	e := outboxOn(t, pool, cfg)
	e.createSlot()
	return e
}

func (e *env) dropSlot() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for {
		err := logrelay.DropSlot(ctx, e.pool, e.cfg, e.slot)
		if err == nil {
			return
		}
		if !errors.Is(err, logrelay.ErrSlotBusy) || ctx.Err() != nil {
			e.t.Logf("drop slot %s: %v", e.slot.Name, err)
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (e *env) createSlot() logrelay.Created {
	e.t.Helper()
	c, err := logrelay.CreateSlot(context.Background(), e.pool, e.cfg, e.slot)
	if err != nil {
		e.t.Fatalf("create slot: %v", err)
	}
	return c
}

// opts are fast timers for tests.
func (e *env) opts() logrelay.Options {
	return logrelay.Options{
		Store: e.cfg, Slot: e.slot,
		Options: core.Options{
			Lanes:           8,
			PublishTimeout:  2 * time.Second,
			RetryBackoff:    core.Backoff{Min: 5 * time.Millisecond, Max: 50 * time.Millisecond},
			ErrorBackoff:    core.Backoff{Min: 5 * time.Millisecond, Max: 200 * time.Millisecond},
			ShutdownTimeout: 5 * time.Second,
			Logger:          testLogger(e.t),
		},
		StandbyInterval:  100 * time.Millisecond,
		StatusInterval:   100 * time.Millisecond,
		ReceiveTimeout:   2 * time.Second,
		WALSenderTimeout: 2 * time.Second,
	}
}

func testLogger(t *testing.T) *slog.Logger {
	if os.Getenv("OUTBOX_TEST_VERBOSE") == "" {
		return slog.New(slog.DiscardHandler)
	}
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) { w.t.Log(string(p)); return len(p), nil }

// running is a relay in the background.
type running struct {
	r      *logrelay.Relay
	cancel context.CancelFunc
	done   chan error
}

func (e *env) start(pub core.Publisher, o logrelay.Options) *running {
	e.t.Helper()
	return startRelay(e.t, e.pool, pub, o)
}

// startPair runs log mode whole, as the binary does (logrelay.Pair): the
// log relay with o and the table path beside it, publishing to pub.
func (e *env) startPair(pub core.Publisher, o logrelay.Options) *running {
	e.t.Helper()
	p, err := logrelay.NewPair(e.pool, pub, o, handOff(e.t, e.pool, o, nil), core.Options{PollInterval: 50 * time.Millisecond})
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	run := &running{r: p.Log, cancel: cancel, done: make(chan error, 1)}
	go func() { run.done <- p.Run(ctx) }()
	e.t.Cleanup(func() { run.stop(e.t) })
	return run
}

// handOff is the table source over the handoff view of o's outbox, as
// the caller of NewPair builds it.
func handOff(t *testing.T, pool *pgxpool.Pool, o logrelay.Options, log *slog.Logger) core.Source {
	t.Helper()
	src, err := table.NewHandOff(pool, o.Store, log)
	if err != nil {
		t.Fatal(err)
	}
	return src
}

func startRelay(t *testing.T, pool *pgxpool.Pool, pub core.Publisher, o logrelay.Options) *running {
	t.Helper()
	r, err := logrelay.New(pool, pub, o)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	run := &running{r: r, cancel: cancel, done: make(chan error, 1)}
	go func() { run.done <- r.Run(ctx) }()
	t.Cleanup(func() { run.stop(t) })
	return run
}

func (r *running) stop(t *testing.T) {
	r.cancel()
	select {
	case err, ok := <-r.done:
		if ok && err != nil {
			t.Errorf("relay: %v", err)
		}
		if ok {
			close(r.done)
		}
	case <-time.After(30 * time.Second):
		t.Error("relay did not stop within 30s")
	}
}

// recorder is a broker: it keeps what it was given, in order, and fails
// the events fail says to.
type recorder struct {
	mu   sync.Mutex
	got  []core.Event
	fail func(e *core.Event) error
}

func (p *recorder) Publish(ctx context.Context, e *core.Event) error {
	p.mu.Lock()
	fail := p.fail
	p.mu.Unlock()
	if fail != nil {
		if err := fail(e); err != nil {
			return err
		}
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	p.mu.Lock()
	c := *e
	c.Payload = append([]byte(nil), e.Payload...)
	p.got = append(p.got, c)
	p.mu.Unlock()
	return nil
}

func (p *recorder) Close() error { return nil }

func (p *recorder) events() []core.Event {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]core.Event(nil), p.got...)
}

// distinct counts the events by id.
func (p *recorder) distinct() map[string]int {
	out := map[string]int{}
	for _, e := range p.events() {
		out[e.ID]++
	}
	return out
}

// waitFor polls cond until it holds or d passes.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

type body struct {
	N int `json:"n"`
}

// write commits one transaction of n events of agg: rows when table,
// else log-only messages. It returns their ids.
func (e *env) write(table bool, agg string, first, n int) []string {
	e.t.Helper()
	ctx := context.Background()
	msgs := make([]outbox.Message, n)
	ids := make([]string, n)
	for i := range msgs {
		ids[i] = uuid.Must(uuid.NewV7()).String()
		b, _ := json.Marshal(body{N: first + i})
		msgs[i] = outbox.Message{ID: ids[i], AggregateID: agg, Type: "order.updated", Payload: b}
	}
	err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		if table {
			return e.rows.Write(ctx, tx, msgs...)
		}
		return e.log.Write(ctx, tx, msgs...)
	})
	if err != nil {
		e.t.Fatalf("write: %v", err)
	}
	return ids
}

// selectorOf selects the row of event id by its seq.
func (e *env) selectorOf(id string) admin.Selector {
	e.t.Helper()
	var seq int64
	if err := e.pool.QueryRow(context.Background(), `SELECT seq FROM `+pgx.Identifier{e.cfg.Schema, e.cfg.Table}.Sanitize()+` WHERE event_id = $1`, id).Scan(&seq); err != nil {
		e.t.Fatal(err)
	}
	return admin.Selector{Seqs: []int64{seq}}
}

func (e *env) count(where string) int {
	e.t.Helper()
	var n int
	if err := e.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+pgx.Identifier{e.cfg.Schema, e.cfg.Table}.Sanitize()+" WHERE "+where).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

func (e *env) status() logrelay.SlotStatus {
	e.t.Helper()
	st, err := logrelay.Inspect(context.Background(), e.pool, e.cfg, e.slot)
	if err != nil {
		e.t.Fatal(err)
	}
	return st
}

func n(e core.Event) int {
	var b body
	_ = json.Unmarshal(e.Payload, &b)
	return b.N
}

// proxiedPool is a pool to the test server through a proxy of its own,
// whose connections the test can cut or black-hole.
func proxiedPool(t *testing.T) (*pgxpool.Pool, *brokertest.Proxy) {
	t.Helper()
	u, err := url.Parse(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	proxy := brokertest.NewProxy(t, u.Host)
	u.Host = proxy.Addr()
	pc, err := pgxpool.ParseConfig(u.String())
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), pc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool, proxy
}
