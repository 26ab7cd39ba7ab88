package logrelay_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/brokers/brokertest"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store/admin"
	"github.com/outboxhq/outbox/store/logrelay"
	"github.com/outboxhq/outbox/store/table"
)

// firstOrder returns, per aggregate, the values of n in the order of their
// first delivery, and how many deliveries were duplicates.
func firstOrder(evs []core.Event) (map[string][]int, int) {
	seen := map[string]bool{}
	out := map[string][]int{}
	dups := 0
	for _, e := range evs {
		if seen[e.ID] {
			dups++
			continue
		}
		seen[e.ID] = true
		out[e.AggregateID] = append(out[e.AggregateID], n(e))
	}
	return out, dups
}

func checkIncreasing(t *testing.T, order map[string][]int) {
	t.Helper()
	for agg, ns := range order {
		for i := 1; i < len(ns); i++ {
			if ns[i] <= ns[i-1] {
				t.Errorf("aggregate %s: %d delivered after %d", agg, ns[i], ns[i-1])
				break
			}
		}
	}
}

// No loss across crashes: the server ends the relay's replication
// connection (as when the relay's process dies) three times while it
// publishes; it reconnects and the slot's stream resumes from the last
// confirmed position, so every event arrives, first deliveries in order
// per aggregate, and the republished ones are counted as duplicates.
func TestDroppedConnectionRepublishesNeverSkips(t *testing.T) {
	e := newEnv(t)
	e.createSlot()
	pub := &recorder{fail: func(*core.Event) error { time.Sleep(200 * time.Microsecond); return nil }}
	o := e.opts()
	o.StatusInterval = 50 * time.Millisecond
	e.start(pub, o)
	aggs := []string{uuid.NewString(), uuid.NewString(), uuid.NewString(), uuid.NewString()}
	const txns = 300
	next := map[string]int{}
	var kills atomic.Int32
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range 3 {
			time.Sleep(400 * time.Millisecond)
			tag, err := e.pool.Exec(context.Background(),
				"SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1 AND active", e.slot.Name)
			if err == nil && tag.RowsAffected() > 0 {
				kills.Add(1)
			}
		}
	}()
	for i := range txns {
		agg := aggs[i%len(aggs)]
		k := 1 + i%5
		e.write(i%3 != 0, agg, next[agg], k)
		next[agg] += k
		time.Sleep(time.Millisecond)
	}
	<-done
	total := 0
	for _, v := range next {
		total += v
	}
	waitFor(t, 60*time.Second, "every event", func() bool { return len(pub.distinct()) == total })
	order, dups := firstOrder(pub.events())
	checkIncreasing(t, order)
	t.Logf("%d events, %d connection drops, %d duplicates", total, kills.Load(), dups)
	if kills.Load() == 0 {
		t.Fatal("no connection was dropped: the test proved nothing")
	}
	waitFor(t, 10*time.Second, "rows marked", func() bool { return e.count("dispatched_at IS NULL") == 0 })
}

// oracle is a second slot, with PostgreSQL's own test_decoding plugin: the
// commit order of the inserts, independent of the relay's decoding.
func oracle(t *testing.T, e *env) func() []string {
	name := "oracle_" + strings.ReplaceAll(e.cfg.Schema, "-", "_")
	if _, err := e.pool.Exec(context.Background(), "SELECT pg_create_logical_replication_slot($1, 'test_decoding')", name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = e.pool.Exec(context.Background(), "SELECT pg_drop_replication_slot($1)", name) })
	re := regexp.MustCompile(`event_id\[uuid\]:'([^']+)'`)
	return func() []string {
		rows, err := e.pool.Query(context.Background(), "SELECT data FROM pg_logical_slot_get_changes($1, NULL, NULL)", name)
		if err != nil {
			t.Fatal(err)
		}
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, l := range lines {
			// The slot sees the whole database: other tests' outboxes too.
			if m := re.FindStringSubmatch(l); m != nil && strings.HasPrefix(l, "table "+e.cfg.Schema+"."+e.cfg.Table+": INSERT") {
				ids = append(ids, m[1])
			}
		}
		return ids
	}
}

// inversions counts, per aggregate, first deliveries that come before an
// event committed earlier.
func inversions(evs []core.Event, commitPos map[string]int) int {
	last := map[string]int{}
	seen := map[string]bool{}
	inv := 0
	for _, e := range evs {
		if seen[e.ID] {
			continue
		}
		seen[e.ID] = true
		p := commitPos[e.ID]
		if l, ok := last[e.AggregateID]; ok && p < l {
			inv++
		}
		last[e.AggregateID] = max(p, last[e.AggregateID])
	}
	return inv
}

// Commit order per aggregate with no help from producers: eight producers
// write two aggregates without locking them, each holding its
// transaction open a random moment after the insert, so seq order (taken
// at insert) and commit order (PostgreSQL's test_decoding tells it) part.
// The table relay publishes the backlog in seq order: reorderings. The
// log relay publishes in commit order: none.
func TestCommitOrderWithoutProducerLocks(t *testing.T) {
	e := newEnv(t)
	e.createSlot()
	commits := oracle(t, e)
	aggs := []string{uuid.NewString(), uuid.NewString()}
	const producers, perProducer = 8, 60
	var wg sync.WaitGroup
	for p := range producers {
		wg.Go(func() {
			ctx := context.Background()
			for i := range perProducer {
				tx, err := e.pool.Begin(ctx)
				if err != nil {
					t.Error(err)
					return
				}
				m := outbox.Message{AggregateID: aggs[(p+i)%2], Type: "order.updated", Payload: fmt.Appendf(nil, `{"n":%d}`, p*1000+i)}
				if err := e.rows.Write(ctx, tx, m); err != nil {
					t.Error(err)
				}
				time.Sleep(time.Duration(rand.N(3000)) * time.Microsecond)
				if err := tx.Commit(ctx); err != nil {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
	ids := commits()
	total := producers * perProducer
	if len(ids) != total {
		t.Fatalf("oracle saw %d inserts, want %d", len(ids), total)
	}
	pos := map[string]int{}
	for i, id := range ids {
		pos[id] = i
	}

	st, err := table.New(e.pool, e.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	table := &recorder{}
	tr, err := core.New(st, table, core.Options{BatchSize: 50, Lanes: 4, PollInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	trDone := make(chan error, 1)
	go func() { trDone <- tr.Run(ctx) }()
	waitFor(t, 30*time.Second, "the table relay's events", func() bool { return len(table.distinct()) == total })
	cancel()
	<-trDone

	// Pending again: the log relay leaves out rows it finds dispatched
	// (published by a relay that read the slot before).
	if _, err := e.pool.Exec(context.Background(), "UPDATE "+pgx.Identifier{e.cfg.Schema, e.cfg.Table}.Sanitize()+" SET dispatched_at = NULL"); err != nil {
		t.Fatal(err)
	}
	log := &recorder{}
	e.start(log, e.opts())
	waitFor(t, 30*time.Second, "the log relay's events", func() bool { return len(log.distinct()) == total })

	tableInv, logInv := inversions(table.events(), pos), inversions(log.events(), pos)
	t.Logf("%d events of 2 aggregates from %d unlocked producers: reorderings against commit order: table mode %d, log mode %d", total, producers, tableInv, logInv)
	if tableInv == 0 {
		t.Error("table mode showed no reordering: the workload did not overlap transactions")
	}
	if logInv != 0 {
		t.Errorf("log mode reordered %d events against commit order", logInv)
	}
}

// Failover: two relays, one holds the slot and the other stands by. When
// the holder's network is cut (a black-holing proxy between it and
// PostgreSQL), the server ends its walsender after wal_sender_timeout and
// the standby takes over within seconds; no event is lost.
func TestFailoverOnNetworkCut(t *testing.T) {
	e := newEnv(t)
	e.createSlot()
	cut, proxy := proxiedPool(t)

	pub := &recorder{}
	a := startRelay(t, cut, pub, e.opts())
	waitFor(t, 10*time.Second, "relay A to hold the slot", a.r.Holding)
	b := e.start(pub, e.opts())
	time.Sleep(500 * time.Millisecond)
	if b.r.Holding() {
		t.Fatal("relay B holds the slot while A does")
	}

	stop := make(chan struct{})
	var written atomic.Int64
	writerDone := make(chan struct{})
	go func() {
		defer close(writerDone)
		agg := uuid.NewString()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			e.write(i%2 == 0, agg, i, 1)
			written.Add(1)
			time.Sleep(5 * time.Millisecond)
		}
	}()
	time.Sleep(300 * time.Millisecond)
	proxy.SetMode(brokertest.BlackHole)
	cutAt := time.Now()
	waitFor(t, 20*time.Second, "relay B to take over", b.r.Holding)
	takeover := time.Since(cutAt)
	time.Sleep(300 * time.Millisecond)
	close(stop)
	<-writerDone
	waitFor(t, 30*time.Second, "every event", func() bool { return int64(len(pub.distinct())) == written.Load() })
	order, dups := firstOrder(pub.events())
	checkIncreasing(t, order)
	t.Logf("takeover %s after the cut (wal_sender_timeout 2s); %d events, %d duplicates", takeover.Round(10*time.Millisecond), written.Load(), dups)
	if takeover > 10*time.Second {
		t.Errorf("takeover took %s, want within 10s", takeover)
	}
	proxy.Heal()
}

// A poison event cannot block the slot: the broker rejects one event of
// aggregate A permanently; it is held in the table with the reason, A's
// later events follow it there, other aggregates go on. `outbox stuck`
// (store.Stuck) shows it; after a retry the table path publishes A's
// events in order, and A's next events come from the log again.
func TestPoisonEventMovesToTheTable(t *testing.T) {
	for _, flavour := range []struct {
		name  string
		table bool
	}{{"rows", true}, {"messages", false}} {
		t.Run(flavour.name, func(t *testing.T) {
			e := newEnv(t)
			e.createSlot()
			a, b := uuid.NewString(), uuid.NewString()
			reject := atomic.Bool{}
			reject.Store(true)
			pub := &recorder{fail: func(ev *core.Event) error {
				if ev.AggregateID == a && n(*ev) == 3 && reject.Load() {
					return core.Permanent(errors.New("no route for this event"))
				}
				return nil
			}}
			hst, err := table.NewHandOff(e.pool, e.cfg, nil)
			if err != nil {
				t.Fatal(err)
			}
			tableRelay, err := core.New(hst, pub, core.Options{PollInterval: 50 * time.Millisecond, DisableWakeups: true})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			trDone := make(chan error, 1)
			go func() { trDone <- tableRelay.Run(ctx) }()
			defer func() { cancel(); <-trDone }()
			o := e.opts()
			o.HandedOff = tableRelay.Wake
			e.start(pub, o)

			for i := range 8 {
				e.write(flavour.table, a, i, 1)
				e.write(flavour.table, b, i, 1)
			}
			waitFor(t, 20*time.Second, "aggregate B and A up to the poison", func() bool {
				o, _ := firstOrder(pub.events())
				return len(o[b]) == 8 && len(o[a]) == 3
			})
			waitFor(t, 10*time.Second, "A's events in the table", func() bool {
				return e.count("handoff_at IS NOT NULL AND dispatched_at IS NULL") == 5
			})
			if c := e.count("retry_at = 'infinity' AND last_error LIKE '%no route for this event%'"); c != 1 {
				t.Fatalf("%d held rows with the broker's reason, want 1", c)
			}
			st, err := admin.New(e.pool, e.cfg, nil)
			if err != nil {
				t.Fatal(err)
			}
			stuck, err := st.Stuck(context.Background(), admin.StuckOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if len(stuck) != 1 || !stuck[0].Held || stuck[0].HeldBack != 4 || stuck[0].AggregateID != a {
				t.Fatalf("stuck = %+v, want A's held event holding 4 back", stuck)
			}
			// A's next event while held goes to the table too.
			e.write(flavour.table, a, 8, 1)
			waitFor(t, 10*time.Second, "A's new event in the table", func() bool {
				return e.count("handoff_at IS NOT NULL AND dispatched_at IS NULL") == 6
			})

			reject.Store(false)
			if _, err := st.Retry(context.Background(), admin.Selector{Seqs: []int64{stuck[0].Seq}}); err != nil {
				t.Fatal(err)
			}
			waitFor(t, 20*time.Second, "A's events through the table", func() bool {
				o, _ := firstOrder(pub.events())
				return len(o[a]) == 9
			})
			// Published is not yet recorded: until the table path marks
			// them, a new event of A rightly follows them to the table.
			waitFor(t, 20*time.Second, "A's handed-off events marked", func() bool {
				return e.count("handoff_at IS NOT NULL AND dispatched_at IS NULL") == 0
			})
			e.write(flavour.table, a, 9, 1)
			waitFor(t, 20*time.Second, "A's next event from the log", func() bool {
				o, _ := firstOrder(pub.events())
				return len(o[a]) == 10
			})
			order, _ := firstOrder(pub.events())
			checkIncreasing(t, order)
			if c := e.count("handoff_at IS NOT NULL"); c != 6 {
				t.Errorf("%d rows handed to the table, want 6 (the poison and the five behind it)", c)
			}
		})
	}
}

// WAL safety: an idle slot advances. Nothing the relay reads is written,
// but other tables write WAL; the relay's status updates confirm the
// server's position, so the slot's lag stays small instead of growing
// with every byte of WAL.
func TestIdleSlotAdvances(t *testing.T) {
	e := newEnv(t)
	e.createSlot()
	e.start(&recorder{}, e.opts())
	ctx := context.Background()
	junk := pgx.Identifier{e.cfg.Schema, "junk"}.Sanitize()
	if _, err := e.pool.Exec(ctx, "CREATE TABLE "+junk+" (x text)"); err != nil {
		t.Fatal(err)
	}
	var before string
	if err := e.pool.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&before); err != nil {
		t.Fatal(err)
	}
	for range 5 {
		if _, err := e.pool.Exec(ctx, "INSERT INTO "+junk+" SELECT repeat('x', 1000) FROM generate_series(1, 2000)"); err != nil {
			t.Fatal(err)
		}
	}
	var written int64
	if err := e.pool.QueryRow(ctx, "SELECT pg_current_wal_lsn() - $1::pg_lsn", before).Scan(&written); err != nil {
		t.Fatal(err)
	}
	if written < 4<<20 {
		t.Fatalf("only %d bytes of WAL written", written)
	}
	waitFor(t, 10*time.Second, "the idle slot to confirm", func() bool { return e.status().LagBytes < 256<<10 })
	t.Logf("%d bytes of WAL written elsewhere; slot lag now %d bytes", written, e.status().LagBytes)
}

// Back-pressure: with the broker down the relay reads at most MaxInFlight
// events and stops, confirms nothing past them, and a relay started after
// it resumes from the confirmed position and delivers every event.
func TestBrokerOutageBoundsMemoryAndResumes(t *testing.T) {
	e := newEnv(t)
	e.createSlot()
	down := &recorder{fail: func(*core.Event) error { return errors.New("broker unreachable") }}
	o := e.opts()
	o.MaxInFlight = 40
	o.ShutdownTimeout = 200 * time.Millisecond
	r := e.start(down, o)
	aggs := []string{uuid.NewString(), uuid.NewString(), uuid.NewString()}
	// An idle relay may confirm WAL up to the first event's commit (other
	// work's, and the event's own records before its commit, which
	// decoding sends again from a position inside them), never past it.
	var firstCommit string
	for i := range 300 {
		e.write(i%2 == 0, aggs[i%3], i/3, 1)
		if i == 0 {
			if err := e.pool.QueryRow(context.Background(), `SELECT pg_current_wal_lsn()::text`).Scan(&firstCommit); err != nil {
				t.Fatal(err)
			}
		}
	}
	peak := int64(0)
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) {
		peak = max(peak, r.r.InFlight())
		time.Sleep(5 * time.Millisecond)
	}
	if peak > int64(o.MaxInFlight) || peak == 0 {
		t.Errorf("in-flight peaked at %d, want 1..%d", peak, o.MaxInFlight)
	}
	if got := e.status().ConfirmedFlush; !lsnAfter(t, firstCommit, got) {
		t.Errorf("slot confirmed %s during the outage, not before %s where the first event's commit ends", got, firstCommit)
	}
	r.stop(t)

	up := &recorder{}
	e.start(up, e.opts())
	waitFor(t, 30*time.Second, "every event after the outage", func() bool { return len(up.distinct()) == 300 })
	order, _ := firstOrder(up.events())
	checkIncreasing(t, order)
	t.Logf("in flight at most %d of 300 events during the outage", peak)
}

// A clear start-up error for a role without REPLICATION; the wal_level
// error is checked in check_internal_test.go.
func TestRoleWithoutReplicationIsRefused(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	role := "norepl_" + strings.TrimPrefix(e.cfg.Schema, "test_")
	if _, err := e.pool.Exec(ctx, "CREATE ROLE "+role+" LOGIN NOREPLICATION"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = e.pool.Exec(context.Background(), "DROP ROLE "+role) })
	pc, err := pgxpool.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	pc.ConnConfig.User = role
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	r, err := logrelay.New(pool, &recorder{}, e.opts())
	if err != nil {
		t.Fatal(err)
	}
	err = r.Run(ctx)
	if err == nil || !strings.Contains(err.Error(), "lacks the REPLICATION attribute") || !strings.Contains(err.Error(), "ALTER ROLE") {
		t.Fatalf("Run = %v, want the REPLICATION error", err)
	}
}

// Switching from table mode: rows pending when the slot is created are
// not in its stream; CreateSlot hands them to the table path, which
// publishes them, and the aggregates' later events follow them. Inspect
// shows the slot and publication; DropSlot refuses an active slot and
// removes an idle one.
func TestSlotLifecycle(t *testing.T) {
	e := newEnv(t)
	agg := uuid.NewString()
	e.write(true, agg, 0, 5)
	c := e.createSlot()
	if !c.Slot || !c.Publication || c.HandedOff != 5 {
		t.Fatalf("CreateSlot = %+v, want both created and 5 rows handed off", c)
	}
	if again := e.createSlot(); again.Slot || again.Publication || again.HandedOff != 0 {
		t.Errorf("second CreateSlot = %+v, want nothing done", again)
	}
	st := e.status()
	want := e.cfg.Schema + "." + e.cfg.Table // format %I quotes only names that need it
	if !st.Exists || st.Plugin != "pgoutput" || !st.PublicationExists || len(st.PublicationTables) != 1 || st.PublicationTables[0] != want {
		t.Fatalf("status = %+v", st)
	}
	pub := &recorder{}
	hst, err := table.NewHandOff(e.pool, e.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	tr, _ := core.New(hst, pub, core.Options{PollInterval: 50 * time.Millisecond, DisableWakeups: true})
	ctx, cancel := context.WithCancel(context.Background())
	trDone := make(chan error, 1)
	go func() { trDone <- tr.Run(ctx) }()
	defer func() { cancel(); <-trDone }()
	r := e.start(pub, e.opts())
	e.write(true, agg, 5, 1)
	waitFor(t, 20*time.Second, "old and new events", func() bool { return len(pub.distinct()) == 6 })
	order, _ := firstOrder(pub.events())
	checkIncreasing(t, order)

	waitFor(t, 5*time.Second, "the relay to hold the slot", r.r.Holding)
	if err := logrelay.DropSlot(context.Background(), e.pool, e.cfg, e.slot); !errors.Is(err, logrelay.ErrSlotBusy) {
		t.Fatalf("DropSlot of an active slot = %v, want ErrSlotBusy", err)
	}
	r.stop(t)
	e.dropSlot()
	if st := e.status(); st.Exists || st.PublicationExists {
		t.Fatalf("after drop: %+v", st)
	}
}

// lsnAfter reports whether LSN a is past b.
func lsnAfter(t *testing.T, a, b string) bool {
	t.Helper()
	x, err := pglogrepl.ParseLSN(a)
	if err != nil {
		t.Fatalf("parse LSN %q: %v", a, err)
	}
	y, err := pglogrepl.ParseLSN(b)
	if err != nil {
		t.Fatalf("parse LSN %q: %v", b, err)
	}
	return x > y
}

// pingingRecorder is a recorder whose broker answers its ping.
type pingingRecorder struct{ recorder }

func (*pingingRecorder) Ping(context.Context) error { return nil }

// An event that keeps failing transiently while others are published, or
// while the broker answers its ping, is moved to the table after
// HandOffAfter attempts, not held: the slot moves past it, its aggregate's
// later events follow it there, other aggregates go on, and once the
// broker takes it the table path publishes it and those behind it, in
// order. Without a ping, the other aggregate's publishes show that the
// broker takes events; with one, the ping alone does.
func TestFailingEventMovesToTheTable(t *testing.T) {
	for _, flavour := range []struct {
		name  string
		table bool
		pings bool
	}{
		{"rows/others-published", true, false},
		{"messages/others-published", false, false},
		{"rows/broker-answers", true, true},
		{"messages/broker-answers", false, true},
	} {
		t.Run(flavour.name, func(t *testing.T) {
			e := newEnv(t)
			e.createSlot()
			o := e.opts()
			o.HandOffAfter = 3
			a, b := uuid.NewString(), uuid.NewString()
			failing := atomic.Bool{}
			failing.Store(true)
			var failures atomic.Int64
			fail := func(ev *core.Event) error {
				if ev.AggregateID == a && n(*ev) == 2 && failing.Load() {
					failures.Add(1)
					return errors.New("flaky downstream")
				}
				return nil
			}
			var pub interface {
				core.Publisher
				events() []core.Event
			} = &recorder{fail: fail}
			if flavour.pings {
				pub = &pingingRecorder{recorder: recorder{fail: fail}}
			}
			e.startPair(pub, o)
			e.write(flavour.table, a, 0, 6)
			e.write(flavour.table, b, 0, 2)
			waitFor(t, 20*time.Second, "A's first two events", func() bool {
				o, _ := firstOrder(pub.events())
				return len(o[a]) == 2
			})
			// The broker takes B's events while A's third fails: written
			// once it has failed, so they are published after its first
			// failure (the rule counts publishes since then).
			waitFor(t, 20*time.Second, "A's third event to fail", func() bool { return failures.Load() > 0 })
			e.write(flavour.table, b, 2, 4)
			// Bound: three failed publishes and one hand-off take well
			// under a second alone; 60 s covers the PostgreSQL that every
			// package of `make test` shares while others fill and migrate
			// tables of 300,000 rows (20 s was seen to run out there).
			waitFor(t, 60*time.Second, "A's failing event in the table, to be retried", func() bool {
				return e.count("handoff_at IS NOT NULL AND retry_at < 'infinity' AND attempts >= 3 AND last_error LIKE '%flaky downstream%'") == 1
			})
			if c := e.count("retry_at = 'infinity'"); c != 0 {
				t.Errorf("%d rows held: a transient failure must not hold its event", c)
			}
			// The slot moves on: B's later events come through the log and
			// the position passes them.
			var mark string
			if err := e.pool.QueryRow(context.Background(), `SELECT pg_current_wal_lsn()::text`).Scan(&mark); err != nil {
				t.Fatal(err)
			}
			e.write(flavour.table, b, 6, 2)
			waitFor(t, 20*time.Second, "B's events and the slot's position past them", func() bool {
				o, _ := firstOrder(pub.events())
				return len(o[b]) == 8 && lsnAfter(t, e.status().ConfirmedFlush, mark)
			})
			if o, _ := firstOrder(pub.events()); len(o[a]) != 2 {
				t.Fatalf("A published %d events while its third failed, want 2", len(o[a]))
			}
			failing.Store(false)
			waitFor(t, 30*time.Second, "A's events through the table once the broker takes them", func() bool {
				o, _ := firstOrder(pub.events())
				return len(o[a]) == 6
			})
			order, _ := firstOrder(pub.events())
			checkIncreasing(t, order)
		})
	}
}

// Replay, retry and unpark in log mode: the log relay reads inserts only,
// so a row made pending again reaches the broker through the table path,
// before the later events of its aggregate.
func TestReplayRetryAndUnparkInLogMode(t *testing.T) {
	e := newEnv(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	st, err := admin.New(e.pool, e.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	// A row parked before the outbox moved to log mode is not in the
	// slot's stream, nor handed off when the slot is created.
	seqOf := e.selectorOf
	a, b := uuid.NewString(), uuid.NewString()
	parked := e.write(true, b, 0, 1)
	if _, err := st.Park(ctx, seqOf(parked[0]), "look"); err != nil {
		t.Fatal(err)
	}
	e.createSlot()
	pub := &recorder{}
	hst, err := table.NewHandOff(e.pool, e.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	tableRelay, err := core.New(hst, pub, core.Options{PollInterval: 50 * time.Millisecond, DisableWakeups: true})
	if err != nil {
		t.Fatal(err)
	}
	trDone := make(chan error, 1)
	go func() { trDone <- tableRelay.Run(ctx) }()
	defer func() { cancel(); <-trDone }()
	o := e.opts()
	o.HandedOff = tableRelay.Wake
	e.start(pub, o)

	ids := e.write(true, a, 0, 3)
	waitFor(t, 20*time.Second, "A's three events from the log", func() bool { return len(pub.distinct()) == 3 })
	waitFor(t, 10*time.Second, "A's events marked", func() bool { return e.count("dispatched_at IS NULL") == 1 })

	n, err := st.Replay(ctx, seqOf(ids[1]), admin.ReplayOptions{})
	if err != nil || n != 1 {
		t.Fatalf("replay: %d, %v", n, err)
	}
	waitFor(t, 20*time.Second, "the replayed event published again", func() bool { return pub.distinct()[ids[1]] == 2 })
	if n, err := st.Unpark(ctx, seqOf(parked[0])); err != nil || n != 1 {
		t.Fatalf("unpark: %d, %v", n, err)
	}
	waitFor(t, 20*time.Second, "the unparked event published", func() bool { return pub.distinct()[parked[0]] == 1 })
	waitFor(t, 10*time.Second, "every row marked", func() bool { return e.count("dispatched_at IS NULL") == 0 })

	// A retried row: failed once in the table path, released by retry.
	if _, err := st.Replay(ctx, seqOf(ids[2]), admin.ReplayOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 20*time.Second, "the second replay published", func() bool { return pub.distinct()[ids[2]] == 2 })
	waitFor(t, 10*time.Second, "every row marked", func() bool { return e.count("dispatched_at IS NULL") == 0 })
	if _, err := e.pool.Exec(ctx, `UPDATE `+pgx.Identifier{e.cfg.Schema, e.cfg.Table}.Sanitize()+
		` SET dispatched_at = NULL, handoff_at = NULL, attempts = 1, retry_at = 'infinity', last_error = 'refused' WHERE event_id = $1`, ids[0]); err != nil {
		t.Fatal(err)
	}
	if n, err := st.Retry(ctx, seqOf(ids[0])); err != nil || n != 1 {
		t.Fatalf("retry: %d, %v", n, err)
	}
	waitFor(t, 20*time.Second, "the retried event published", func() bool { return pub.distinct()[ids[0]] == 2 })
	waitFor(t, 10*time.Second, "every row marked", func() bool { return e.count("dispatched_at IS NULL") == 0 })
}

// An event committed right after an unpark or a replay of its aggregate
// follows the rows the command handed off, though nothing but the log
// tells the relay of the command (logTable.handOffPrefix).
func TestEventAfterUnparkOrReplayFollowsIt(t *testing.T) {
	for _, table := range []bool{true, false} {
		t.Run(map[bool]string{true: "rows", false: "messages"}[table], func(t *testing.T) {
			e := newEnv(t)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			st, err := admin.New(e.pool, e.cfg, nil)
			if err != nil {
				t.Fatal(err)
			}
			bySeq := e.selectorOf
			agg := uuid.NewString()
			// Parked before the slot exists, so neither the stream nor
			// the slot's creation hands it off.
			parked := e.write(true, agg, 0, 1)[0]
			if _, err := st.Park(ctx, bySeq(parked), "look"); err != nil {
				t.Fatal(err)
			}
			e.createSlot()
			pub := &recorder{}
			o := e.opts()
			e.startPair(pub, o)

			first := e.write(table, agg, 1, 1)[0]
			waitFor(t, 20*time.Second, "the first event from the log", func() bool { return pub.distinct()[first] == 1 })
			if n, err := st.Unpark(ctx, bySeq(parked)); err != nil || n != 1 {
				t.Fatalf("unpark: %d, %v", n, err)
			}
			afterUnpark := e.write(table, agg, 2, 1)[0]
			waitFor(t, 20*time.Second, "the unparked event and the next", func() bool {
				d := pub.distinct()
				return d[parked] == 1 && d[afterUnpark] == 1
			})
			// A log-only event has a row only once handed off: with
			// messages, replay the unparked row.
			replayed := first
			if !table {
				replayed = parked
			}
			waitFor(t, 10*time.Second, "every row marked", func() bool { return e.count("dispatched_at IS NULL") == 0 })
			if n, err := st.Replay(ctx, bySeq(replayed), admin.ReplayOptions{}); err != nil || n != 1 {
				t.Fatalf("replay: %d, %v", n, err)
			}
			afterReplay := e.write(table, agg, 3, 1)[0]
			waitFor(t, 20*time.Second, "the event after the replay", func() bool { return pub.distinct()[afterReplay] == 1 })

			var order []string
			for _, ev := range pub.events() {
				order = append(order, ev.ID)
			}
			at := func(id string, nth int) int {
				for i, x := range order {
					if x == id {
						if nth--; nth == 0 {
							return i
						}
					}
				}
				return -1
			}
			if at(parked, 1) > at(afterUnpark, 1) {
				t.Errorf("the event written after the unpark went out before the unparked one: %v", order)
			}
			if at(replayed, 2) < 0 || at(replayed, 2) > at(afterReplay, 1) {
				t.Errorf("the event written after the replay went out before the replayed one: %v", order)
			}
		})
	}
}

// A fast shutdown of PostgreSQL waits until the log relay has confirmed
// all it was sent, and the relay cannot confirm a row it cannot mark
// while the server refuses connections. So the relay ends its stream once
// the server says it is shutting down, and reads the row again later.
// Here the marks fail as they do then (cannot_connect_now).
func TestStreamEndsWhenTheServerShutsDown(t *testing.T) {
	e := newEnv(t)
	e.createSlot()
	ctx := context.Background()
	table := pgx.Identifier{e.cfg.Schema, e.cfg.Table}.Sanitize()
	refuse := pgx.Identifier{e.cfg.Schema, "refuse_marks"}.Sanitize()
	exec := func(sql string) {
		t.Helper()
		if _, err := e.pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	exec(`CREATE FUNCTION ` + refuse + `() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'the database system is shutting down' USING ERRCODE = 'cannot_connect_now'; END $$`)
	exec(`CREATE TRIGGER refuse_marks BEFORE UPDATE ON ` + table + ` FOR EACH ROW
WHEN (NEW.dispatched_at IS NOT NULL) EXECUTE FUNCTION ` + refuse + `()`)
	pub := &recorder{}
	startRelay(t, e.pool, pub, e.opts())
	walsender := func() int32 {
		var pid *int32
		if err := e.pool.QueryRow(ctx, `SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1`, e.slot.Name).Scan(&pid); err != nil {
			t.Fatal(err)
		}
		if pid == nil {
			return 0
		}
		return *pid
	}
	waitFor(t, 10*time.Second, "the relay to read the slot", func() bool { return walsender() != 0 })
	first := walsender()
	e.writeMsgs(true, outbox.Message{AggregateID: "a", Type: "order.placed", Payload: []byte(`{"n":1}`)})
	// Every stream publishes it again until a mark succeeds.
	waitFor(t, 10*time.Second, "the event published", func() bool { return len(pub.events()) >= 1 })
	waitFor(t, 10*time.Second, "the stream that sent it to end", func() bool { return walsender() != first })
	exec(`DROP TRIGGER refuse_marks ON ` + table)
	waitFor(t, 10*time.Second, "the event marked", func() bool { return e.count("dispatched_at IS NOT NULL") == 1 })
}
