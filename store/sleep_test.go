package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store/pgtest"
)

// Producers notify only while a relay sleeps (migration 10): a plain
// INSERT from any client wakes a sleeping relay and costs nothing
// otherwise; a relay going to sleep first waits for the transactions that
// wrote without notifying, so its next claim sees them.
func TestProducersWakeOnlyASleepingRelay(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	in := newInstance(t, pool, cfg)
	ctx := context.Background()
	// Other tests' producers notify the same channel: only this
	// producer's notifications count.
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
	fromProducer := func(c *pgx.Conn, within time.Duration) bool {
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

	if err := in.s.Sleep(ctx, time.Second); err != nil {
		t.Fatal(err)
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

	// A transaction that wrote while nobody slept holds the relay's sleep
	// until it commits.
	tx, err := prod.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, insert); err != nil {
		t.Fatal(err)
	}
	slept := make(chan error, 1)
	go func() { slept <- in.s.Sleep(ctx, 10*time.Second) }()
	select {
	case err := <-slept:
		t.Fatalf("slept (%v) while a producer that did not notify was still open", err)
	case <-time.After(300 * time.Millisecond):
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-slept; err != nil {
		t.Fatal(err)
	}
	c, err := in.s.Claim(ctx, core.ClaimOptions{Limit: 100, Unordered: true})
	if err != nil {
		t.Fatal(err)
	}
	if n := len(c.Events()); n != 4 {
		t.Errorf("the claim after sleeping sees %d events, want 4", n)
	}
	if err := c.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if err := in.s.Awake(ctx); err != nil {
		t.Fatal(err)
	}

	// A transaction that stays open bounds the sleep by its limit.
	tx, err = prod.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, insert); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := in.s.Sleep(ctx, 200*time.Millisecond); err == nil {
		t.Error("slept while a producer that did not notify stays open")
	}
	if took := time.Since(start); took > 3*time.Second {
		t.Errorf("a sleep limited to 200ms took %s", took)
	}
}
