package logrelay_test

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
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
	"github.com/outboxhq/outbox/store/logrelay"
	"github.com/outboxhq/outbox/store/migrate"
	"github.com/outboxhq/outbox/store/table"
)

// envFailoverPGBin names a folder of PostgreSQL 17 or later server
// binaries (initdb, pg_ctl, postgres): the failover test starts a primary
// and a standby of its own from them. `make test-pg` sets it.
const envFailoverPGBin = "OUTBOX_TEST_FAILOVER_PG_BIN"

// timedRecorder is a broker that notes when each event came.
type timedRecorder struct {
	mu  sync.Mutex
	got []timedEvent
}

type timedEvent struct {
	id, agg string
	n       int
	at      time.Time
}

func (p *timedRecorder) Publish(ctx context.Context, e *core.Event) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	var b body
	if err := json.Unmarshal(e.Payload, &b); err != nil {
		return err
	}
	p.mu.Lock()
	p.got = append(p.got, timedEvent{id: e.ID, agg: e.AggregateID, n: b.N, at: time.Now()})
	p.mu.Unlock()
	return nil
}

func (p *timedRecorder) Close() error { return nil }

func (p *timedRecorder) events() []timedEvent {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]timedEvent(nil), p.got...)
}

// A primary and a physical standby with synchronous replication, the
// settings docs/operations.md gives for a failover, and two outboxes: one
// in log mode (rows and log-only events, logrelay.Pair) and one in table
// mode. Producers write while the relays run against both hosts
// (target_session_attrs=read-write); the primary is killed, the standby
// promoted, and the producers and relays go on against it. Then, with the
// promoted standby's database as the truth (each event's transaction also
// inserts a ledger row): every event committed there is published (in
// particular every acknowledged one: replication is synchronous), no
// event is published that is not there, the first publishes of each
// aggregate are in commit order, and duplicates are counted and bounded.
func TestFailoverToStandby(t *testing.T) {
	bin := os.Getenv(envFailoverPGBin)
	if bin == "" {
		t.Skipf("%s is not set: `make test-pg` runs this on PostgreSQL 17 and 18", envFailoverPGBin)
	}
	ctx := context.Background()
	// With pgtest's wal_level=logical and fsync=off.
	common := map[string]string{"max_wal_senders": "20", "max_replication_slots": "20",
		"wal_sender_timeout": "'5s'", "wal_receiver_status_interval": "'1s'"}
	primary := pgtest.Start(t, pgtest.Options{Bin: bin, Settings: common})
	admin := connect(t, primary.URL)
	for _, q := range []string{
		"CREATE DATABASE outbox_test",
		"SELECT pg_create_physical_replication_slot('standby1', true)",
	} {
		if _, err := admin.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}

	standbySettings := map[string]string{
		"primary_conninfo":       fmt.Sprintf("'host=127.0.0.1 port=%d user=postgres dbname=outbox_test application_name=standby1'", primary.Port),
		"primary_slot_name":      "'standby1'",
		"hot_standby_feedback":   "on",
		"sync_replication_slots": "on",
	}
	maps.Copy(standbySettings, common)
	standby := pgtest.Start(t, pgtest.Options{Bin: bin, Settings: standbySettings, Fill: func(data string) {
		baseBackup(ctx, t, primary, data)
		if err := os.WriteFile(filepath.Join(data, "standby.signal"), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}})
	waitFor(t, 60*time.Second, "the standby streaming", func() bool {
		var n int
		_ = admin.QueryRow(ctx, "SELECT count(*) FROM pg_stat_replication WHERE application_name = 'standby1' AND state = 'streaming'").Scan(&n)
		return n == 1
	})
	for _, q := range []string{
		"ALTER SYSTEM SET synchronous_standby_names = 'standby1'",
		"ALTER SYSTEM SET synchronized_standby_slots = 'standby1'",
		"SELECT pg_reload_conf()",
	} {
		if _, err := admin.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	admin.Close()

	both := fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/outbox_test?sslmode=disable&target_session_attrs=read-write&connect_timeout=2",
		primary.Port, standby.Port)
	pool := connect(t, both)
	if _, err := pool.Exec(ctx, "CREATE TABLE ledger (event_id uuid PRIMARY KEY, outbox text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	logCfg, tableCfg := store.Config{Schema: "logmode"}, store.Config{Schema: "tablemode"}
	for _, c := range []*store.Config{&logCfg, &tableCfg} {
		var err error
		if *c, err = c.WithDefaults(); err != nil {
			t.Fatal(err)
		}
		if _, err := migrate.Migrate(ctx, pool, *c); err != nil {
			t.Fatal(err)
		}
	}
	slot, err := logrelay.Slot{}.Resolve(ctx, pool, logCfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := logrelay.CreateSlot(ctx, pool, logCfg, slot); err != nil {
		t.Fatal(err)
	}
	if ws, err := logrelay.FailoverWarnings(ctx, pool); err != nil || len(ws) > 0 {
		t.Fatalf("failover warnings with every setting made: %q, %v", ws, err)
	}

	// The relays.
	logPub, tablePub := &timedRecorder{}, &timedRecorder{}
	rctx, stopRelays := context.WithCancel(ctx)
	var relays sync.WaitGroup
	t.Cleanup(func() { stopRelays(); relays.Wait() })
	o := logrelay.Options{
		Store: logCfg, Slot: slot,
		Options: core.Options{
			PublishTimeout:  2 * time.Second,
			ErrorBackoff:    core.Backoff{Min: 50 * time.Millisecond, Max: 500 * time.Millisecond},
			ShutdownTimeout: 5 * time.Second,
			Logger:          testLogger(t),
		},
		StandbyInterval: 200 * time.Millisecond, StatusInterval: 200 * time.Millisecond,
		ReceiveTimeout: 3 * time.Second, WALSenderTimeout: 3 * time.Second,
	}
	pair, err := logrelay.NewPair(pool, logPub, o, handOff(t, pool, o, testLogger(t)), core.Options{PollInterval: 50 * time.Millisecond, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	tableStore, err := table.New(pool, tableCfg, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	tableRelay, err := core.New(tableStore, tablePub, core.Options{PollInterval: 50 * time.Millisecond, Logger: testLogger(t),
		ErrorBackoff: core.Backoff{Min: 50 * time.Millisecond, Max: 500 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	relays.Go(func() { _ = pair.Run(rctx) })
	relays.Go(func() { _ = tableRelay.Run(rctx) })

	// The standby has the slot once it synchronized it.
	standbyAdmin := connect(t, standby.Database("outbox_test"))
	waitFor(t, 90*time.Second, "the slot synchronized to the standby", func() bool {
		var ok bool
		_ = standbyAdmin.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND synced AND NOT temporary)", slot.Name).Scan(&ok)
		return ok
	})
	standbyAdmin.Close()

	// The producers: per outbox, an aggregate per goroutine, one event
	// per transaction; in log mode every other one log-only.
	p := &producers{t: t, acked: map[string]bool{}}
	wctx, stopWriters := context.WithCancel(ctx)
	var writers sync.WaitGroup
	for i := range 4 {
		writers.Go(func() { p.run(wctx, pool, logCfg, "log", fmt.Sprintf("log-%d", i), true) })
		writers.Go(func() { p.run(wctx, pool, tableCfg, "table", fmt.Sprintf("table-%d", i), false) })
	}
	waitFor(t, 60*time.Second, "events acknowledged before the failover", func() bool { return p.ackedCount() >= 400 })
	if err := primary.Stop("immediate", 60*time.Second); err != nil {
		t.Fatal(err)
	}
	beforeKill := p.ackedCount()
	if err := standby.Promote(60 * time.Second); err != nil {
		t.Fatal(err)
	}
	promoted := time.Now()
	waitFor(t, 60*time.Second, "events acknowledged after the promotion", func() bool { return p.ackedCount() >= beforeKill+400 })
	stopWriters()
	writers.Wait()

	// The truth: what the promoted standby committed.
	committed := map[string]string{}
	rows, err := pool.Query(ctx, "SELECT event_id::text, outbox FROM ledger")
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id, ob string
		if err := rows.Scan(&id, &ob); err != nil {
			t.Fatal(err)
		}
		committed[id] = ob
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for id := range p.acked {
		if committed[id] == "" {
			t.Errorf("event %s acknowledged but not in the promoted standby's database", id)
		}
	}
	for _, mode := range []struct {
		name string
		pub  *timedRecorder
	}{{"log", logPub}, {"table", tablePub}} {
		want := 0
		for _, ob := range committed {
			if ob == mode.name {
				want++
			}
		}
		waitFor(t, 60*time.Second, mode.name+" mode's events published", func() bool {
			seen := map[string]bool{}
			for _, e := range mode.pub.events() {
				if committed[e.id] == mode.name {
					seen[e.id] = true
				}
			}
			return len(seen) == want
		})
		time.Sleep(500 * time.Millisecond) // for late duplicates or phantoms
		got := mode.pub.events()
		seen, last := map[string]int{}, map[string]int{}
		firstAfter := time.Duration(-1)
		for _, e := range got {
			if committed[e.id] != mode.name {
				t.Errorf("%s mode: event %s (%s #%d) published but not committed", mode.name, e.id, e.agg, e.n)
			}
			seen[e.id]++
			if seen[e.id] == 1 {
				if e.n <= last[e.agg] {
					t.Errorf("%s mode: aggregate %s published #%d after #%d", mode.name, e.agg, e.n, last[e.agg])
				}
				last[e.agg] = e.n
			}
			if firstAfter < 0 && e.at.After(promoted) {
				firstAfter = e.at.Sub(promoted)
			}
		}
		dups := len(got) - len(seen)
		t.Logf("%s mode: %d events committed, %d published, %d duplicates; first publish %v after the promotion",
			mode.name, want, len(got), dups, firstAfter.Round(time.Millisecond))
		// A redelivery comes from the synchronized slot's position (log
		// mode) or a mark the failover cut off (table mode): at most every
		// event written before the kill.
		if dups > beforeKill {
			t.Errorf("%s mode: %d duplicates, more than the %d events written before the failover", mode.name, dups, beforeKill)
		}
	}
}

func connect(t *testing.T, url string) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// producers write events, each with a ledger row in its transaction, and
// note the acknowledged ones.
type producers struct {
	t     *testing.T
	mu    sync.Mutex
	acked map[string]bool
	count atomic.Int64
}

func (p *producers) ackedCount() int { return int(p.count.Load()) }

func (p *producers) run(ctx context.Context, pool *pgxpool.Pool, cfg store.Config, outboxName, agg string, logOnly bool) {
	rows, err := outbox.NewWriter(outbox.WriterOptions{Store: cfg})
	if err != nil {
		p.t.Error(err)
		return
	}
	logw, err := outbox.NewLogWriter(outbox.WriterOptions{Store: cfg})
	if err != nil {
		p.t.Error(err)
		return
	}
	for n := 1; ctx.Err() == nil; n++ {
		id := uuid.Must(uuid.NewV7()).String()
		b, _ := json.Marshal(body{N: n})
		m := outbox.Message{ID: id, AggregateID: agg, Type: "order.updated", Payload: b}
		wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := pgx.BeginFunc(wctx, pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(wctx, "INSERT INTO ledger VALUES ($1, $2)", id, outboxName); err != nil {
				return err
			}
			if logOnly && n%2 == 0 {
				return logw.Write(wctx, tx, m)
			}
			return rows.Write(wctx, tx, m)
		})
		cancel()
		if err != nil {
			// The primary is gone, or not yet promoted: try again soon.
			time.Sleep(50 * time.Millisecond)
			continue
		}
		p.mu.Lock()
		p.acked[id] = true
		p.mu.Unlock()
		p.count.Add(1)
		time.Sleep(5 * time.Millisecond)
	}
}
