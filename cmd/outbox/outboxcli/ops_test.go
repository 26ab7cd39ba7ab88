package outboxcli

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"

	"github.com/outboxhq/outbox/brokers/brokertest"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/metrics"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/table"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		goleak.IgnoreTopFunction("github.com/jackc/pgx/v5/pgxpool.(*Pool).backgroundHealthCheck"),
		// Started by the Pub/Sub client's init, which the example config test imports.
		goleak.IgnoreTopFunction("go.opencensus.io/stats/view.(*worker).start"),
		// Sarama's metrics registry starts a ticker it never stops (the
		// kafka readiness check).
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
		goleak.IgnoreAnyFunction("github.com/eapache/go-resiliency/breaker.(*Breaker).timer"))
}

type okPublisher struct{}

func (okPublisher) Publish(context.Context, *core.Event) error { return nil }
func (okPublisher) Close() error                               { return nil }

func getReady(t *testing.T, h http.Handler) (int, map[string]string) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
	var body struct {
		Ready  bool              `json:"ready"`
		Checks map[string]string `json:"checks"`
	}
	if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil {
		t.Fatalf("readyz body %q: %v", rec.Body.String(), err)
	}
	if body.Ready != (rec.Code == http.StatusOK) {
		t.Errorf("readyz says ready=%v with status %d", body.Ready, rec.Code)
	}
	return rec.Code, body.Checks
}

func TestReadyzFlipsWhenDatabaseUnreachable(t *testing.T) {
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
	defer pool.Close()
	st, err := table.New(pool, store.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}

	r, err := core.New(st, okPublisher{}, core.Options{PollInterval: 5 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := r.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer r.Stop(context.Background())
	h := opsHandler(prometheus.NewRegistry(), r.Ready, discardLogger())

	if code, res := getReady(t, h); code != http.StatusOK || res["store"] != "ok" {
		t.Fatalf("readyz = %d %v while everything is up", code, res)
	}
	proxy.Cut()
	code, res := getReady(t, h)
	if code != http.StatusServiceUnavailable || res["store"] == "ok" || res["progress"] != "ok" {
		t.Errorf("readyz with the database cut = %d %v, want 503 naming the store", code, res)
	}

	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/healthz", nil))
	if rec.Code != http.StatusOK {
		t.Errorf("healthz = %d, want 200 while the process runs", rec.Code)
	}
}

func TestMetricsEndpoint(t *testing.T) {
	reg := prometheus.NewRegistry()
	obs, err := metrics.NewObserver(metrics.Options{Registerer: reg, Broker: "stdout"})
	if err != nil {
		t.Fatal(err)
	}
	obs.Published(&core.Event{Type: "order.placed", CreatedAt: time.Now()}, time.Millisecond, nil)
	rec := httptest.NewRecorder()
	opsHandler(reg, func(context.Context) []core.Check { return nil }, discardLogger()).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	if want := `outbox_events_published_total{broker="stdout",outcome="ok",topic="order"} 1`; !strings.Contains(rec.Body.String(), want) {
		t.Errorf("/metrics lacks %s:\n%s", want, rec.Body.String())
	}
}

// opsFixture is a migrated schema with events in known states.
type opsFixture struct {
	t      *testing.T
	pool   *pgxpool.Pool
	cfg    store.Config
	ids    map[string]int64
	aggOld string
}

func newOpsFixture(t *testing.T) *opsFixture {
	pool, cfg := pgtest.Schema(t)
	f := &opsFixture{t: t, pool: pool, cfg: cfg, ids: map[string]int64{}, aggOld: uuid.NewString()}
	table := pgx.Identifier{cfg.Schema, "events_outbox"}.Sanitize()
	for _, r := range []struct {
		name, typ, agg, created, dispatched, retry string
	}{
		{"old-dispatched", "order.placed", f.aggOld, "10 days", "9 days", ""},
		{"recent-dispatched", "order.placed", uuid.NewString(), "1 hour", "1 hour", ""},
		{"pending", "order.paid", uuid.NewString(), "1 second", "", ""},
		{"stuck", "order.shipped", uuid.NewString(), "1 hour", "", ""},
		{"held", "bad.type", uuid.NewString(), "1 minute", "", "infinity"},
	} {
		var id int64
		err := pool.QueryRow(context.Background(), `INSERT INTO `+table+` (event_id, aggregate_id, type, payload, created_at, dispatched_at, retry_at)
VALUES (gen_random_uuid(), $1, $2, '{}', now() - $3::interval, now() - NULLIF($4, '')::interval, NULLIF($5, '')::timestamptz)
RETURNING seq`, r.agg, r.typ, r.created, r.dispatched, r.retry).Scan(&id)
		if err != nil {
			t.Fatal(err)
		}
		f.ids[r.name] = id
	}
	return f
}

// run executes the command line against the fixture's schema.
func (f *opsFixture) run(args ...string) (string, string, error) {
	var out, errOut bytes.Buffer
	root := NewRoot(&out, &errOut)
	root.SetArgs(append(args, "--database-url", pgtest.URL(f.t), "--schema", f.cfg.Schema, "--log-level", "warn"))
	err := root.ExecuteContext(context.Background())
	return out.String(), errOut.String(), err
}

func (f *opsFixture) runJSON(v any, args ...string) {
	f.t.Helper()
	out, errOut, err := f.run(append(args, "--json")...)
	if err != nil {
		f.t.Fatalf("%v: %v\n%s", args, err, errOut)
	}
	if err := json.Unmarshal([]byte(out), v); err != nil {
		f.t.Fatalf("%v: output is not JSON: %v\n%s", args, err, out)
	}
}

func TestStatusCommand(t *testing.T) {
	f := newOpsFixture(t)
	var s statusJSON
	f.runJSON(&s, "status")
	if s.Pending != 3 || s.Held != 1 || s.Stuck != 2 || s.OldestPendingSeconds < 3500 || s.OldestPending == nil {
		t.Errorf("status = %+v; want 3 pending, 1 held, 2 stuck, oldest about an hour", s)
	}
	out, _, err := f.run("status")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"pending", "oldest pending", "publish rate", "stuck", "2 (due and pending over 5m0s, or held)", "scheduled"} {
		if !strings.Contains(out, want) {
			t.Errorf("status output lacks %q:\n%s", want, out)
		}
	}
}

func TestCleanupCommand(t *testing.T) {
	f := newOpsFixture(t)
	var dry cleanupJSON
	f.runJSON(&dry, "cleanup", "--dry-run")
	if !dry.DryRun || dry.OutboxDeleted != 1 {
		t.Errorf("dry run = %+v, want 1 event to delete", dry)
	}
	var res cleanupJSON
	f.runJSON(&res, "cleanup", "--batch", "10")
	if res.OutboxDeleted != 1 || res.DispatchedWindowSeconds != (7*24*time.Hour).Seconds() {
		t.Errorf("cleanup = %+v, want 1 deleted with the 7-day default", res)
	}
	var left int
	if err := f.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+pgx.Identifier{f.cfg.Schema, "events_outbox"}.Sanitize()).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != 4 {
		t.Errorf("%d events left, want 4", left)
	}
	if _, _, err := f.run("cleanup", "--dispatched", "-1h"); err == nil || !strings.Contains(err.Error(), "--dispatched") {
		t.Errorf("negative window: err = %v, want one naming --dispatched", err)
	}
}

func TestReplayCommand(t *testing.T) {
	f := newOpsFixture(t)
	var r replayJSON
	f.runJSON(&r, "replay", "--type", "order.placed", "--created-after", "240h", "--dry-run")
	if r.Replayed != 1 || !r.DryRun {
		t.Errorf("dry run = %+v, want 1 (the recent one only: the old one is from 10 days ago)", r)
	}
	f.runJSON(&r, "replay", "--aggregate", f.aggOld)
	if r.Replayed != 1 || r.DryRun {
		t.Errorf("replay = %+v, want 1", r)
	}
	var s statusJSON
	f.runJSON(&s, "status")
	if s.Pending != 4 {
		t.Errorf("after replay %d pending, want 4", s.Pending)
	}
	if _, _, err := f.run("replay"); err == nil || !strings.Contains(err.Error(), "selector is empty") {
		t.Errorf("replay without criteria: err = %v", err)
	}
	if _, _, err := f.run("replay", "--type", "x", "--created-after", "yesterday"); err == nil || !strings.Contains(err.Error(), "--created-after") {
		t.Errorf("bad time: err = %v", err)
	}
}

func TestPoisonCommands(t *testing.T) {
	f := newOpsFixture(t)
	var stuck []stuckJSON
	f.runJSON(&stuck, "stuck")
	if len(stuck) != 2 || stuck[0].Seq != f.ids["stuck"] || !stuck[1].Held {
		t.Fatalf("stuck = %+v, want the old pending event and the held one", stuck)
	}
	held := strconv.FormatInt(f.ids["held"], 10)
	var c countJSON
	f.runJSON(&c, "park", "--seq", held, "--reason", "unknown type, ticket 42")
	if c.Count != 1 {
		t.Errorf("park = %+v", c)
	}
	if _, _, err := f.run("park", "--id", held); err == nil || !strings.Contains(err.Error(), "reason") {
		t.Errorf("park without a reason: err = %v", err)
	}
	f.runJSON(&stuck, "stuck", "--parked")
	if len(stuck) != 2 || stuck[1].ParkedReason != "unknown type, ticket 42" {
		t.Errorf("stuck --parked = %+v", stuck)
	}
	f.runJSON(&c, "unpark", "--seq", held)
	if c.Count != 1 {
		t.Errorf("unpark = %+v", c)
	}
	out, _, err := f.run("retry", "--type", "bad.type", "--json")
	if ExitCode(err) != ExitNoMatch || json.Unmarshal([]byte(out), &c) != nil || c.Count != 0 {
		t.Errorf("retry after unpark = %q (err %v), want a count of 0 and exit code %d: unpark already cleared the hold",
			out, err, ExitNoMatch)
	}
	out, _, err = f.run("stuck", "--older-than", "1s")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, "order.shipped") || !strings.Contains(out, "ATTEMPTS") {
		t.Errorf("stuck table:\n%s", out)
	}
}

func discardLogger() *slog.Logger {
	return newLogger(io.Discard, LogConfig{Format: "text", Level: "error"})
}

// outbox_partitions_owned is every partition while a relay does not share,
// and its share once a second relay shares the table.
func TestPartitionsOwnedGauge(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	cfg.ShareInterval = 50 * time.Millisecond
	gauge := func(reg *prometheus.Registry) string {
		rec := httptest.NewRecorder()
		opsHandler(reg, func(context.Context) []core.Check { return nil }, discardLogger()).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
		for _, l := range strings.Split(rec.Body.String(), "\n") {
			if strings.HasPrefix(l, "outbox_partitions_owned ") {
				return l
			}
		}
		return ""
	}
	var stores []*table.Source
	for range 2 {
		st, err := table.New(pool, cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		stores = append(stores, st)
	}
	reg := prometheus.NewRegistry()
	registerPartitions(reg, stores[0])
	if got := gauge(reg); got != "outbox_partitions_owned 32" {
		t.Fatalf("unshared: %q, want every partition", got)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var done sync.WaitGroup
	for _, st := range stores {
		done.Go(func() { _ = st.Share(ctx, func(float64) {}) })
	}
	defer func() { cancel(); done.Wait() }()
	deadline := time.Now().Add(5 * time.Second)
	for gauge(reg) != "outbox_partitions_owned 16" {
		if time.Now().After(deadline) {
			t.Fatalf("shared by two relays: %q, want 16", gauge(reg))
		}
		time.Sleep(20 * time.Millisecond)
	}
}
