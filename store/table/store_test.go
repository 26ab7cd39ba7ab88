package table_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/claimtest"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/admin"
	"github.com/outboxhq/outbox/store/migrate"
	"github.com/outboxhq/outbox/store/table"
)

// pgx closes a connection cut off mid-query (a LISTEN whose relay
// stopped) in a goroutine of its own, bounded by 15s; it is pgx's, and it
// ends once the server has closed the connection.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/jackc/pgx/v5/pgconn.(*PgConn).asyncClose.func1"))
}

type harness struct{}

func (harness) Open(t *testing.T) claimtest.Instance {
	pool, cfg := pgtest.Schema(t)
	return newInstance(t, pool, cfg)
}

type instance struct {
	pool *pgxpool.Pool
	cfg  store.Config
	s    *table.Source
	ad   *admin.Admin
	w    *outbox.Writer
}

func newInstance(t *testing.T, pool *pgxpool.Pool, cfg store.Config) *instance {
	t.Helper()
	s, err := table.New(pool, cfg, nil)
	if err != nil {
		t.Fatalf("new store: %v", err)
	}
	ad, err := admin.New(pool, cfg, nil)
	if err != nil {
		t.Fatalf("new admin: %v", err)
	}
	w, err := outbox.NewWriter(outbox.WriterOptions{Store: cfg})
	if err != nil {
		t.Fatalf("new writer: %v", err)
	}
	return &instance{pool: pool, cfg: s.Config(), s: s, ad: ad, w: w}
}

func (in *instance) Source() core.Source { return in.s }

func (in *instance) table() string { return pgx.Identifier{in.cfg.Schema, in.cfg.Table}.Sanitize() }

func (in *instance) Produce(ctx context.Context, events []core.Event, commit bool) error {
	tx, err := in.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	msgs := make([]outbox.Message, len(events))
	for i, e := range events {
		msgs[i] = outbox.Message{AggregateID: e.AggregateID, Type: e.Type, Payload: e.Payload, Headers: e.Headers, ID: e.ID}
	}
	if err := in.w.Write(ctx, tx, msgs...); err != nil {
		return err
	}
	if !commit {
		return tx.Rollback(ctx)
	}
	return tx.Commit(ctx)
}

func (in *instance) Pending(ctx context.Context) ([]int64, error) {
	rows, err := in.pool.Query(ctx, "SELECT seq FROM "+in.table()+" WHERE dispatched_at IS NULL ORDER BY seq")
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[int64])
}

// Crash terminates every session holding a lock on the outbox table: the
// open claims.
func (in *instance) Crash(ctx context.Context, t *testing.T) {
	t.Helper()
	var n int
	err := in.pool.QueryRow(ctx, `
SELECT count(pg_terminate_backend(pid)) FROM (
    SELECT DISTINCT l.pid FROM pg_locks l
    WHERE l.relation = $1::regclass AND l.pid <> pg_backend_pid()
) AS holders`, in.table()).Scan(&n)
	if err != nil {
		t.Fatalf("terminate claim sessions: %v", err)
	}
	if n == 0 {
		t.Fatal("no session held a claim to terminate")
	}
	// Termination is asynchronous; wait until the locks are gone.
	deadline := time.Now().Add(10 * time.Second)
	for {
		var holders int
		err := in.pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE relation = $1::regclass AND pid <> pg_backend_pid()`, in.table()).Scan(&holders)
		if err != nil {
			t.Fatalf("count lock holders: %v", err)
		}
		if holders == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d sessions still hold locks after termination", holders)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestConformance(t *testing.T) { claimtest.Run(t, harness{}) }

// A claim holds a transaction; when the relay's connection dies during the
// claim the events are claimable again at once.
func TestKilledClaimIsReclaimable(t *testing.T) {
	ctx := context.Background()
	pool, cfg := pgtest.Schema(t)
	in := newInstance(t, pool, cfg)
	agg := "00000000-0000-4000-8000-000000000001"
	if err := in.Produce(ctx, []core.Event{{AggregateID: agg, Type: "t.x", Payload: []byte(`{}`)}}, true); err != nil {
		t.Fatal(err)
	}
	c, err := in.s.Claim(ctx, core.ClaimOptions{Limit: 10})
	if err != nil || len(c.Events()) != 1 {
		t.Fatalf("claim: %v, %d events", err, len(c.Events()))
	}
	blocked, err := in.s.Claim(ctx, core.ClaimOptions{Limit: 10})
	if err != nil || len(blocked.Events()) != 0 {
		t.Fatalf("second claim while the first is open: %v, %d events", err, len(blocked.Events()))
	}
	in.Crash(ctx, t)
	again, err := in.s.Claim(ctx, core.ClaimOptions{Limit: 10})
	if err != nil {
		t.Fatalf("claim after the kill: %v", err)
	}
	if len(again.Events()) != 1 || again.Events()[0].Seq != c.Events()[0].Seq {
		t.Fatalf("after the kill claimed %d events, want the killed claim's event", len(again.Events()))
	}
	if err := again.Complete(ctx, []int64{again.Events()[0].Seq}, nil); err != nil {
		t.Fatal(err)
	}
	if err := c.Release(ctx); err == nil {
		t.Log("release of the killed claim reported no error")
	}
}

func TestFailureRecorded(t *testing.T) {
	ctx := context.Background()
	pool, cfg := pgtest.Schema(t)
	in := newInstance(t, pool, cfg)
	agg := "00000000-0000-4000-8000-000000000001"
	if err := in.Produce(ctx, []core.Event{{AggregateID: agg, Type: "t.x", Payload: []byte(`{}`)}}, true); err != nil {
		t.Fatal(err)
	}
	c, err := in.s.Claim(ctx, core.ClaimOptions{Limit: 10})
	if err != nil {
		t.Fatal(err)
	}
	long := strings.Repeat("é", 3000) // 6000 bytes: cut to the limit on a rune boundary
	if err := c.Complete(ctx, nil, []core.Failure{{Seq: c.Events()[0].Seq, Reason: long}}); err != nil {
		t.Fatalf("complete: %v", err)
	}
	var (
		attempts int
		reason   string
		infinite bool
	)
	err = pool.QueryRow(ctx, "SELECT attempts, last_error, retry_at = 'infinity' FROM "+in.table()).Scan(&attempts, &reason, &infinite)
	if err != nil {
		t.Fatal(err)
	}
	if attempts != 1 || !infinite || len(reason) == 0 || len(reason) > 2000 || !strings.HasPrefix(long, reason) {
		t.Fatalf("recorded attempts=%d held=%v reason of %d bytes", attempts, infinite, len(reason))
	}
}

func TestPayloadAndHeadersRoundTrip(t *testing.T) {
	ctx := context.Background()
	pool, cfg := pgtest.Schema(t)
	in := newInstance(t, pool, cfg)
	payload := []byte("{ \"z\" : 1,\n  \"a\":[1.50, \"\\u00e9\", null] ,\"z\":2 }")
	headers := map[string]string{"traceparent": "00-abc-def-01", "tenant": "ünï"}
	agg := "00000000-0000-4000-8000-000000000001"
	if err := in.Produce(ctx, []core.Event{{AggregateID: agg, Type: "t.x", Payload: payload, Headers: headers}}, true); err != nil {
		t.Fatal(err)
	}
	c, err := in.s.Claim(ctx, core.ClaimOptions{Limit: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release(ctx)
	e := c.Events()[0]
	if string(e.Payload) != string(payload) {
		t.Fatalf("payload came back as %q, want the exact bytes %q", e.Payload, payload)
	}
	if len(e.Headers) != 2 || e.Headers["traceparent"] != headers["traceparent"] || e.Headers["tenant"] != headers["tenant"] {
		t.Fatalf("headers came back as %v, want %v", e.Headers, headers)
	}
	if e.AggregateID != agg || e.ID == "" {
		t.Fatalf("aggregate %q uid %q", e.AggregateID, e.ID)
	}
}

func TestConfigValidation(t *testing.T) {
	for _, tc := range []struct {
		cfg   store.Config
		field string
	}{
		{store.Config{Table: strings.Repeat("t", 48)}, "table"},
		{store.Config{Schema: "a\x00b"}, "schema"},
		{store.Config{ProcessedTable: "\xff"}, "processed_table"},
		{store.Config{NotifyChannel: strings.Repeat("c", 64)}, "notify_channel"},
		{store.Config{Table: "same", ProcessedTable: "same"}, "processed_table"},
	} {
		_, err := tc.cfg.WithDefaults()
		if err == nil || !strings.Contains(err.Error(), tc.field) {
			t.Errorf("config %+v: error %v, want one naming %s", tc.cfg, err, tc.field)
		}
	}
	cfg, err := store.Config{}.WithDefaults()
	if err != nil || cfg.Schema != "public" || cfg.Table != "events_outbox" || cfg.NotifyChannel != "events_outbox" {
		t.Fatalf("defaults: %+v, %v", cfg, err)
	}
}

// Names from configuration reach SQL only quoted: a hostile table name
// works as a name, and nothing else in the database is touched.
func TestHostileNames(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.NewPool(t)
	suffix := fmt.Sprint(time.Now().UnixNano() % 1e9)
	victim := pgx.Identifier{"v" + suffix}.Sanitize()
	cfg := store.Config{
		Schema:         `s "; DROP TABLE ` + victim + `; --` + suffix,
		Table:          `evil"; DROP TABLE x; --`,
		ProcessedTable: `it's; DELETE FROM ` + victim + ` --`,
		NotifyChannel:  `ch"; NOTIFY x; --`,
	}
	if _, err := pool.Exec(ctx, "CREATE TABLE "+victim+" (v int); INSERT INTO "+victim+" VALUES (1)"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		pool.Exec(context.Background(), "DROP TABLE IF EXISTS "+victim)
		pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{cfg.Schema}.Sanitize()+" CASCADE")
	})
	if _, err := migrate.Migrate(ctx, pool, cfg); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	in := newInstance(t, pool, cfg)
	agg := "00000000-0000-4000-8000-000000000001"
	if err := in.Produce(ctx, []core.Event{{AggregateID: agg, Type: "t.x", Payload: []byte(`{}`)}}, true); err != nil {
		t.Fatalf("write: %v", err)
	}
	c, err := in.s.Claim(ctx, core.ClaimOptions{Limit: 10})
	if err != nil {
		t.Fatalf("claim: %v", err)
	}
	if len(c.Events()) != 1 {
		t.Fatalf("claimed %d events, want 1", len(c.Events()))
	}
	if err := c.Complete(ctx, []int64{c.Events()[0].Seq}, nil); err != nil {
		t.Fatalf("complete: %v", err)
	}
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+victim).Scan(&n); err != nil || n != 1 {
		t.Fatalf("the unrelated table was harmed: count %d, %v", n, err)
	}
	var tables int
	err = pool.QueryRow(ctx, "SELECT count(*) FROM information_schema.tables WHERE table_schema = $1 AND table_type = 'BASE TABLE'", cfg.Schema).Scan(&tables)
	if err != nil || tables != 4 {
		t.Fatalf("schema %q has %d tables (%v), want outbox, processed, migrations and log slot", cfg.Schema, tables, err)
	}
	p, err := in.Pending(ctx)
	if err != nil || len(p) != 0 {
		t.Fatalf("pending after complete: %v, %v", p, err)
	}
}

// recordingPublisher signals each publish.
type recordingPublisher struct{ got chan string }

func (p *recordingPublisher) Publish(ctx context.Context, e *core.Event) error {
	select {
	case p.got <- e.ID:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (p *recordingPublisher) Close() error { return nil }

// claimCounter is a core.Observer counting the relay's claims.
type claimCounter struct{ n atomic.Int64 }

func (c *claimCounter) Claimed(int, time.Duration)                  { c.n.Add(1) }
func (c *claimCounter) Published(*core.Event, time.Duration, error) {}
func (c *claimCounter) Completed(int, int, time.Duration)           {}
func (c *claimCounter) Errored(string, error)                       {}
func (*claimCounter) Rejected(*core.Event, error)                   {}

// startRelay runs a relay whose poll interval is far longer than the test,
// so only a wake-up can make it claim again.
func startRelay(t *testing.T, s *table.Source) (*recordingPublisher, *claimCounter) {
	t.Helper()
	pub := &recordingPublisher{got: make(chan string, 100)}
	obs := &claimCounter{}
	r, err := core.New(s, pub, core.Options{PollInterval: time.Hour, Observer: obs})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("relay: %v", err)
		}
	})
	return pub, obs
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// writeAndAwait commits one event and waits for the relay to publish it.
func writeAndAwait(t *testing.T, in *instance, pub *recordingPublisher, within time.Duration) time.Duration {
	t.Helper()
	ctx := context.Background()
	ev := core.Event{ID: uuid.NewString(), AggregateID: "00000000-0000-4000-8000-000000000001", Type: "t.x", Payload: []byte(`{}`)}
	start := time.Now()
	if err := in.Produce(ctx, []core.Event{ev}, true); err != nil {
		t.Fatal(err)
	}
	timeout := time.After(within)
	for {
		select {
		case uid := <-pub.got:
			if uid == ev.ID {
				return time.Since(start)
			}
		case <-timeout:
			t.Fatalf("a committed write did not wake the relay within %v", within)
		}
	}
}

func listenerPIDs(t *testing.T, pool *pgxpool.Pool, channel string) []int {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT pid FROM pg_stat_activity WHERE query = $1`, "LISTEN "+pgx.Identifier{channel}.Sanitize())
	if err != nil {
		t.Fatal(err)
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		t.Fatal(err)
	}
	return pids
}

// awaitListening waits for a listener session other than old, and for the
// claims that its connect-time wake-up and the relay's start cause: after
// that, only a notification can make the relay claim.
func awaitListening(t *testing.T, pool *pgxpool.Pool, channel string, obs *claimCounter, old []int) []int {
	t.Helper()
	before := obs.n.Load()
	var pids []int
	waitFor(t, "a listener session", func() bool {
		pids = listenerPIDs(t, pool, channel)
		return len(pids) == 1 && !slices.Contains(old, pids[0])
	})
	want := before + 1
	if old == nil {
		want = 2 // the first cycle and the one the listener's wake-up starts
	}
	waitFor(t, "the wake-up of a new listener", func() bool { return obs.n.Load() >= want })
	return pids
}

// The Writer's NOTIFY wakes a relay sleeping out an hour-long poll.
func TestWriteWakesRelay(t *testing.T) {
	pool, cfg := pgtest.SchemaWith(t, store.Config{NotifyChannel: "wake_" + uuid.NewString()}) // not shared with other tests
	in := newInstance(t, pool, cfg)
	pub, obs := startRelay(t, in.s)
	awaitListening(t, pool, cfg.NotifyChannel, obs, nil)
	d := writeAndAwait(t, in, pub, 5*time.Second)
	t.Logf("commit to publish: %v", d)

	// A row inserted by plain SQL, naming only the columns a SQL producer
	// must, wakes it too: the table's trigger sends the NOTIFY.
	ctx := context.Background()
	var uid string
	err := pool.QueryRow(ctx, `INSERT INTO `+in.table()+` (aggregate_id, type, payload)
VALUES ('00000000-0000-4000-8000-000000000002', 'order.placed', '{"n":1}') RETURNING event_id::text`).Scan(&uid)
	if err != nil {
		t.Fatalf("plain SQL insert: %v", err)
	}
	select {
	case got := <-pub.got:
		if got != uid {
			t.Fatalf("published %s, want the SQL row %s", got, uid)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a row inserted by SQL did not wake the relay")
	}

	// With the trigger disabled, a write waits for the poll.
	if _, err := pool.Exec(ctx, `ALTER TABLE `+in.table()+` DISABLE TRIGGER `+pgx.Identifier{in.cfg.Table + "_notify"}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	// Let the cycles the earlier wake-ups started end first: the relay is
	// quiet once no claim has come for 200ms (it polls hourly).
	claims, quiet, limit := obs.n.Load(), time.Now(), time.Now().Add(3*time.Second)
	for time.Since(quiet) < 200*time.Millisecond {
		if time.Now().After(limit) {
			t.Fatal("the relay keeps claiming with nothing to do")
		}
		time.Sleep(10 * time.Millisecond)
		if n := obs.n.Load(); n != claims {
			claims, quiet = n, time.Now()
		}
	}
	// And asleep: a relay on its way to sleep claims once more after it
	// takes the wake-up lock (migration 10), and on a loaded machine that
	// step can outlast the quiet window.
	waitFor(t, "the relay asleep", func() bool {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND mode = 'ExclusiveLock' AND granted
  AND objsubid = 1 AND ((classid::bigint << 32) | objid::bigint) = hashtextextended($1, 0)`,
			"outbox-wake:"+in.cfg.Schema+"."+in.cfg.Table).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 1
	})
	claims = obs.n.Load()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	msg := outbox.Message{AggregateID: "00000000-0000-4000-8000-000000000001", Type: "t.x", Payload: []byte(`{}`)}
	if err := in.w.Write(ctx, tx, msg); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	if got := obs.n.Load() - claims; got != 0 {
		t.Fatalf("%d claims after a write with the trigger disabled, want 0", got)
	}
}

// After the listener's connection is killed, Listen reconnects and a new
// commit still wakes the relay.
func TestListenReconnectsAfterKill(t *testing.T) {
	pool, cfg := pgtest.SchemaWith(t, store.Config{NotifyChannel: "wake_" + uuid.NewString()})
	in := newInstance(t, pool, cfg)
	pub, obs := startRelay(t, in.s)
	old := awaitListening(t, pool, cfg.NotifyChannel, obs, nil)
	writeAndAwait(t, in, pub, 5*time.Second)

	if _, err := pool.Exec(context.Background(), "SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) AS pid", old); err != nil {
		t.Fatal(err)
	}
	awaitListening(t, pool, cfg.NotifyChannel, obs, old)
	d := writeAndAwait(t, in, pub, 5*time.Second)
	t.Logf("commit to publish after the listener was killed: %v", d)
}

func TestPing(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	s, err := table.New(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Ping(context.Background()); err != nil {
		t.Fatalf("ping: %v", err)
	}
	pool.Close()
	if err := s.Ping(context.Background()); err == nil || !errors.Is(err, err) {
		t.Fatal("ping on a closed pool succeeded")
	}
}

// Claim sizes its result from the request; odd limits must give an error or
// an empty claim, never a panic or a huge allocation.
func TestClaimOddLimits(t *testing.T) {
	ctx := context.Background()
	pool, cfg := pgtest.Schema(t)
	in := newInstance(t, pool, cfg)
	if err := in.Produce(ctx, []core.Event{{AggregateID: "00000000-0000-4000-8000-000000000001", Type: "t.x", Payload: []byte(`{}`)}}, true); err != nil {
		t.Fatal(err)
	}
	if _, err := in.s.Claim(ctx, core.ClaimOptions{Limit: -1}); err == nil {
		t.Fatal("a negative limit was accepted")
	}
	c, err := in.s.Claim(ctx, core.ClaimOptions{Limit: 1 << 40})
	if err != nil || len(c.Events()) != 1 {
		t.Fatalf("claim with a huge limit: %v", err)
	}
	if err := c.Release(ctx); err != nil {
		t.Fatal(err)
	}
	c, err = in.s.Claim(ctx, core.ClaimOptions{Limit: 0})
	if err != nil || len(c.Events()) != 0 {
		t.Fatalf("claim with limit 0: %v, %d events", err, len(c.Events()))
	}
}

// A relay configured with another notify channel than the one the table
// was migrated with still wakes on commits: it listens on the trigger's too.
func TestListenFollowsTriggerChannel(t *testing.T) {
	table := "t_" + strings.ReplaceAll(uuid.NewString(), "-", "")[:12]
	pool, cfg := pgtest.SchemaWith(t, store.Config{Table: table}) // the trigger notifies the table's name
	cfg.NotifyChannel = "elsewhere_" + uuid.NewString()
	in := newInstance(t, pool, cfg)
	pub, obs := startRelay(t, in.s)
	awaitListening(t, pool, table, obs, nil) // the listener's last statement
	writeAndAwait(t, in, pub, 5*time.Second)
}

// A publish error can carry any bytes. Recorded as they are, bytes that
// are not UTF-8, or a NUL, would fail the outcome's whole record, and the
// batch's next attempt the same way; they are recorded as text instead.
func TestFailureReasonThatIsNotText(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	in := newInstance(t, pool, cfg)
	ctx := context.Background()
	in.produceSpread(ctx, t, 2)
	c, err := in.s.Claim(ctx, core.ClaimOptions{Limit: 10})
	if err != nil {
		t.Fatal(err)
	}
	ev := c.Events()
	if len(ev) != 2 {
		t.Fatalf("claimed %d events, want 2", len(ev))
	}
	if err := c.Complete(ctx, []int64{ev[0].Seq}, []core.Failure{{Seq: ev[1].Seq, Reason: "broker said \xff\x00 no"}}); err != nil {
		t.Fatalf("complete: %v", err)
	}
	var reason string
	if err := pool.QueryRow(ctx, "SELECT last_error FROM "+in.table()+" WHERE seq = $1 AND retry_at = 'infinity'", ev[1].Seq).Scan(&reason); err != nil {
		t.Fatal(err)
	}
	if want := "broker said \ufffd\ufffd no"; reason != want {
		t.Fatalf("reason %q, want %q", reason, want)
	}
}

// roundTrips counts what a pool sends the server: each statement sent on
// its own and each batch is one round trip.
type roundTrips struct{ n atomic.Int64 }

func (r *roundTrips) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	r.n.Add(1)
	return ctx
}
func (r *roundTrips) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (r *roundTrips) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	r.n.Add(1)
	return ctx
}
func (r *roundTrips) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (r *roundTrips) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// Between a producer's commit and the broker lies one claim: one round
// trip to the server, its BEGIN included, and one more to record the
// outcome and commit. Across a network each round trip is latency every
// event pays.
func TestClaimIsOneRoundTrip(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	in := newInstance(t, pool, cfg)
	ctx := context.Background()
	trips := &roundTrips{}
	s := storeOver(t, pool, cfg, func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = trips })
	for _, unordered := range []bool{false, true} {
		cycle := func() (claim, complete int64) {
			t.Helper()
			in.produceSpread(ctx, t, 3)
			before := trips.n.Load()
			c, err := s.Claim(ctx, core.ClaimOptions{Limit: 10, Unordered: unordered})
			if err != nil {
				t.Fatal(err)
			}
			claim = trips.n.Load() - before
			var ids []int64
			for _, e := range c.Events() {
				ids = append(ids, e.Seq)
			}
			if len(ids) != 3 {
				t.Fatalf("claimed %d events, want 3", len(ids))
			}
			if err := c.Complete(ctx, ids, nil); err != nil {
				t.Fatal(err)
			}
			return claim, trips.n.Load() - before - claim
		}
		cycle() // statements are prepared on first use
		if claim, complete := cycle(); claim != 1 || complete != 1 {
			t.Errorf("unordered %v: claim took %d round trips, its record %d; want 1 each", unordered, claim, complete)
		}
		before := trips.n.Load()
		c, err := s.Claim(ctx, core.ClaimOptions{Limit: 10, Unordered: unordered})
		if err != nil {
			t.Fatal(err)
		}
		if n := len(c.Events()); n != 0 {
			t.Fatalf("claimed %d events, want none", n)
		}
		if n := trips.n.Load() - before; n != 2 {
			t.Errorf("unordered %v: an empty claim took %d round trips, want 2 (the claim and its rollback)", unordered, n)
		}
	}
}

// storeOver returns a store over a pool of its own, configured as pool is
// and then by configure, for tests that watch what the store sends. The
// pool closes when the test ends.
func storeOver(t *testing.T, pool *pgxpool.Pool, cfg store.Config, configure func(*pgxpool.Config)) *table.Source {
	t.Helper()
	pc := pool.Config().Copy()
	configure(pc)
	own, err := pgxpool.NewWithConfig(context.Background(), pc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(own.Close)
	s, err := table.New(own, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	return s
}
