package oracle_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/oracle"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store/logrelay"
	"github.com/outboxhq/outbox/store/table"
)

// relay is one relay process of the history's mode, wired as the outbox
// command wires it: in table mode a core.Relay over the table; in log mode
// a logrelay.Pair (the log relay and, beside it, a core.Relay over the
// handoff view).
type relay struct {
	name  string // application_name of its sessions
	pool  *pgxpool.Pool
	table *core.Relay
	log   *logrelay.Relay
	// pub is the process's own Kafka publisher on a Kafka path (nil
	// with the in-process broker): closed on a graceful stop, abandoned
	// on a kill.
	pub core.Publisher

	cancel  context.CancelFunc
	logDone chan error
}

// Fast timers: the run settles within a few hundred milliseconds.
var (
	retryBackoff = core.Backoff{Min: 10 * time.Millisecond, Max: 100 * time.Millisecond}
	errorBackoff = core.Backoff{Min: 10 * time.Millisecond, Max: 200 * time.Millisecond}
)

func (d *driver) start() {
	d.t.Helper()
	d.relay = d.launch(true)
}

// takeover starts a second relay beside the running one, lets them share
// the work a moment (units move between them, each new owner fencing the
// old), then kills the first. Its Kafka producers are left running, not
// silenced: they may still commit what they hold, or find themselves
// fenced, as a relay that froze and woke up does.
func (d *driver) takeover() {
	d.t.Helper()
	old := d.relay
	nu := d.launch(false)
	time.Sleep(takeoverOverlap)
	old.kill(d.t, d.pool)
	if d.kafka != nil {
		d.kafka.leave(old.pub)
	}
	if nu.log != nil {
		d.waitHolding(nu)
	}
	d.relay = nu
}

// takeoverOverlap is how long two relays run side by side in a takeover.
const takeoverOverlap = 400 * time.Millisecond

// launch starts a relay process. In log mode with hold set it waits
// until the log relay holds the slot.
func (d *driver) launch(hold bool) *relay {
	d.t.Helper()
	d.generation++
	r := &relay{name: fmt.Sprintf("oracle-%s-%d", d.cfg.Schema, d.generation)}
	pc, err := pgxpool.ParseConfig(pgtest.URL(d.t))
	if err != nil {
		d.t.Fatal(err)
	}
	pc.MaxConns = 6
	pc.ConnConfig.RuntimeParams["application_name"] = r.name
	if r.pool, err = pgxpool.NewWithConfig(context.Background(), pc); err != nil {
		d.t.Fatal(err)
	}
	ro := core.Options{
		BatchSize: 20, Lanes: 4, PollInterval: 50 * time.Millisecond, PublishTimeout: 2 * time.Second,
		ShutdownTimeout: 2 * time.Second, Unordered: d.h.Mode == oracle.TableUnordered,
		RetryBackoff: retryBackoff, ErrorBackoff: errorBackoff,
	}
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	var pub core.Publisher = d.pub
	if d.kafka != nil {
		r.pub = d.kafka.publisher(d.t)
		pub = &faulty{Publisher: r.pub, b: d.pub}
	}
	if !d.h.Mode.Log() {
		st, err := table.New(r.pool, d.cfg, nil)
		if err != nil {
			d.t.Fatal(err)
		}
		if r.table, err = core.New(st, pub, ro); err != nil {
			d.t.Fatal(err)
		}
		if err := r.table.Start(ctx); err != nil {
			d.t.Fatal(err)
		}
		return r
	}
	lo := logrelay.Options{
		Store: d.cfg, Slot: d.slot,
		Options: core.Options{Lanes: 4, PublishTimeout: 2 * time.Second, RetryBackoff: retryBackoff, HandOffAfter: 3,
			ErrorBackoff: errorBackoff, ShutdownTimeout: 2 * time.Second},
		StandbyInterval: 100 * time.Millisecond, StatusInterval: 100 * time.Millisecond,
		ReceiveTimeout: 2 * time.Second, WALSenderTimeout: 2 * time.Second,
		ApplicationName: r.name,
	}
	handoff, err := table.NewHandOff(r.pool, d.cfg, nil)
	if err != nil {
		d.t.Fatal(err)
	}
	pair, err := logrelay.NewPair(r.pool, pub, lo, handoff, ro)
	if err != nil {
		d.t.Fatal(err)
	}
	r.table, r.log = pair.Table, pair.Log
	r.logDone = make(chan error, 1)
	go func() { r.logDone <- pair.Run(ctx) }()
	if hold {
		d.waitHolding(r)
	}
	return r
}

// waitHolding waits until r's log relay holds the slot. The slot exists
// from then on; events written before were written before the slot.
func (d *driver) waitHolding(r *relay) {
	d.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !r.log.Holding() {
		if time.Now().After(deadline) {
			d.t.Fatal("the log relay did not take its slot within 20s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	d.slotMade = true
}

func (r *relay) wake() { r.table.Wake() }

// stop stops the relay gracefully.
func (d *driver) stop() {
	d.t.Helper()
	if d.relay == nil {
		return
	}
	r := d.relay
	d.relay = nil
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := r.table.Stop(ctx); err != nil {
		d.t.Errorf("stop the table relay: %v", err)
	}
	r.cancel()
	if r.log != nil {
		if err := <-r.logDone; err != nil {
			d.t.Errorf("log relay: %v", err)
		}
	}
	r.pool.Close()
	if r.pub != nil {
		if err := r.pub.Close(); err != nil {
			d.t.Errorf("close the kafka publisher: %v", err)
		}
	}
}

// kill stops the relay as a crash does: its database sessions end first
// (open claims roll back, the replication connection drops), then the
// process stops without waiting for publishes in flight.
func (r *relay) kill(t *testing.T, admin *pgxpool.Pool) {
	t.Helper()
	if _, err := admin.Exec(context.Background(), "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1", r.name); err != nil {
		t.Fatalf("terminate %s: %v", r.name, err)
	}
	expired, cancel := context.WithCancel(context.Background())
	cancel()
	_ = r.table.Stop(expired)
	r.cancel()
	if r.log != nil {
		<-r.logDone // its error is the killed connection's
	}
	r.pool.Close()
}
