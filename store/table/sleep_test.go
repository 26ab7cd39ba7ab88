package table_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
)

// Producers notify only while a relay sleeps (migration 10): a plain
// INSERT from any client wakes a sleeping relay and costs nothing
// otherwise. A relay going to sleep waits for nothing: when transactions
// that wrote without notifying are open, its request for the wake-up
// lock waits for them in the background and notifies once they commit,
// so its next claim, and every other sleeping relay's, sees them.
func TestProducersWakeOnlyASleepingRelay(t *testing.T) {
	pool, cfg := pgtest.SchemaWith(t, store.Config{NotifyChannel: uniqueChannel()})
	in := newInstance(t, pool, cfg)
	ctx := context.Background()
	prod, err := pgx.ConnectConfig(ctx, pool.Config().ConnConfig.Copy())
	if err != nil {
		t.Fatal(err)
	}
	defer prod.Close(ctx)
	pid := prod.PgConn().PID()
	// A connection that LISTENs on the table's channel.
	listener := func() *pgx.Conn {
		t.Helper()
		c, err := pgx.ConnectConfig(ctx, pool.Config().ConnConfig.Copy())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.Exec(ctx, "LISTEN "+pgx.Identifier{in.cfg.NotifyChannel}.Sanitize()); err != nil {
			t.Fatal(err)
		}
		return c
	}
	listen := listener()
	defer listen.Close(ctx)
	insert := "INSERT INTO " + in.table() + " (aggregate_id, type, payload) VALUES ('agg', 't.x', '{}')"
	write := func() {
		t.Helper()
		if _, err := prod.Exec(ctx, insert); err != nil {
			t.Fatal(err)
		}
	}
	// from reports a notification from the session pid within the time.
	from := func(c *pgx.Conn, pid uint32, within time.Duration) bool {
		t.Helper()
		wctx, cancel := context.WithTimeout(ctx, within)
		defer cancel()
		for {
			n, err := c.WaitForNotification(wctx)
			if err != nil {
				return false
			}
			if n.PID == pid {
				return true
			}
		}
	}
	fromProducer := func(c *pgx.Conn, within time.Duration) bool { return from(c, pid, within) }
	// A pgx connection whose wait was cut by its context is closed: a
	// fresh one for every wait that must time out.
	quiet := func(what string) {
		t.Helper()
		c := listener()
		defer c.Close(ctx)
		write()
		if fromProducer(c, 300*time.Millisecond) {
			t.Errorf("%s: a producer notified with no relay asleep", what)
		}
	}
	quiet("before any sleep")
	defer in.s.CloseSleeper(ctx)

	if now, err := in.s.Sleep(ctx); err != nil || !now {
		t.Fatalf("sleep with the lock free: now %v, error %v; want now", now, err)
	}
	write()
	if !fromProducer(listen, 5*time.Second) {
		t.Fatal("a producer did not wake the sleeping relay")
	}
	if err := in.s.Awake(ctx); err != nil {
		t.Fatal(err)
	}
	listen.Close(ctx)
	quiet("after the relay woke")

	// A transaction that wrote while nobody slept does not hold the
	// relay's sleep back: the sleep leaves its request waiting, and once
	// the transaction commits the request is granted and notifies, as the
	// producer did not.
	sleeperWoke := func(c *pgx.Conn, within time.Duration) bool {
		t.Helper()
		wctx, cancel := context.WithTimeout(ctx, within)
		defer cancel()
		for {
			n, err := c.WaitForNotification(wctx)
			if err != nil {
				return false
			}
			if n.PID != pid {
				return true
			}
		}
	}
	listen = listener()
	defer listen.Close(ctx)
	tx, err := prod.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, insert); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if now, err := in.s.Sleep(ctx); err != nil || now {
		t.Fatalf("sleep beside an open producer: now %v, error %v; want a waiting request", now, err)
	}
	if took := time.Since(start); took > time.Second {
		t.Errorf("sleep beside an open producer took %s, want no wait", took)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if !sleeperWoke(listen, 5*time.Second) {
		t.Fatal("no wake-up once the producer that did not notify committed")
	}
	c, err := in.s.Claim(ctx, core.ClaimOptions{Limit: 100, Unordered: true})
	if err != nil {
		t.Fatal(err)
	}
	if n := len(c.Events()); n != 4 {
		t.Errorf("the claim after the wake-up sees %d events, want 4", n)
	}
	if err := c.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if err := in.s.Awake(ctx); err != nil {
		t.Fatal(err)
	}

	// While a transaction stays open, a relay that sleeps has producers
	// notify all the same, and wakes at once.
	tx, err = prod.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, insert); err != nil {
		t.Fatal(err)
	}
	if now, err := in.s.Sleep(ctx); err != nil || now {
		t.Fatalf("sleep beside an open producer: now %v, error %v; want a waiting request", now, err)
	}
	// Sleep returns before its request reaches the server; producers
	// notify from the moment it waits there.
	waitFor(t, "the sleep's lock request to wait on the server", func() bool {
		var waiting bool
		err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_locks
WHERE locktype = 'advisory' AND objsubid = 1 AND NOT granted
  AND ((classid::bigint << 32) | objid::bigint) = hashtextextended($1, 0))`,
			"outbox-wake:"+in.cfg.Schema+"."+in.cfg.Table).Scan(&waiting)
		return err == nil && waiting
	})
	other, err := pgx.ConnectConfig(ctx, pool.Config().ConnConfig.Copy())
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close(ctx)
	if _, err := other.Exec(ctx, insert); err != nil {
		t.Fatal(err)
	}
	if !from(listen, other.PgConn().PID(), 5*time.Second) {
		t.Error("a producer did not wake the relay whose sleep waits behind an open transaction")
	}
	start = time.Now()
	if err := in.s.Awake(ctx); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took > time.Second {
		t.Errorf("waking beside an open producer took %s", took)
	}
	// The open transaction took the lock shared before the relay slept,
	// and keeps it: producers no longer notify.
	if _, err := other.Exec(ctx, insert); err != nil {
		t.Fatal(err)
	}
	if from(listen, other.PgConn().PID(), 300*time.Millisecond) {
		t.Error("a producer notified after the waiting relay woke")
	}
}

// Producers that wrote while no relay slept, and commit one by one while
// the relay's sleep waits behind them, wake it each time: one that stays
// open does not hide the others' commits.
func TestSilentCommitWakesBesideAnOpenProducer(t *testing.T) {
	pool, cfg := pgtest.SchemaWith(t, store.Config{NotifyChannel: uniqueChannel()})
	in := newInstance(t, pool, cfg)
	ctx := context.Background()
	defer in.s.CloseSleeper(ctx)
	listen, err := pgx.ConnectConfig(ctx, pool.Config().ConnConfig.Copy())
	if err != nil {
		t.Fatal(err)
	}
	defer listen.Close(ctx)
	if _, err := listen.Exec(ctx, "LISTEN "+pgx.Identifier{in.cfg.NotifyChannel}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	insert := "INSERT INTO " + in.table() + " (aggregate_id, type, payload) VALUES ($1, 't.x', '{}')"
	open := func(agg string) pgx.Tx {
		t.Helper()
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, insert, agg); err != nil {
			t.Fatal(err)
		}
		return tx
	}
	long := open("long")
	defer long.Rollback(ctx)
	short := open("short")
	if now, err := in.s.Sleep(ctx); err != nil || now {
		t.Fatalf("sleep beside open producers: now %v, error %v; want a waiting request", now, err)
	}
	if err := short.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	wctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	if _, err := listen.WaitForNotification(wctx); err != nil {
		t.Fatalf("no wake-up within 3s of a commit that did not notify, beside an open producer: %v", err)
	}
	t.Logf("woken %s after the commit", time.Since(start))
	evs := in.claimAll(ctx, t, true)
	if len(evs) != 1 || evs[0].AggregateID != "short" {
		t.Errorf("the claim after the wake-up got %d events, want the committed one", len(evs))
	}
	if err := in.s.Awake(ctx); err != nil {
		t.Fatal(err)
	}
}
