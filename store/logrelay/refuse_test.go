package logrelay_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/brokers/brokertest"
	"github.com/outboxhq/outbox/core"

	"github.com/outboxhq/outbox/store/logrelay"
)

// runErr starts a relay and waits, bounded by d, for Run to return.
func runErr(t *testing.T, r *running, d time.Duration) error {
	t.Helper()
	select {
	case err := <-r.done:
		close(r.done)
		return err
	case <-time.After(d):
		t.Fatalf("Run did not return within %s", d)
		return nil
	}
}

// A publication that stops publishing the outbox table's inserts (here
// the table is removed from it under a running relay) is refused: the
// stream would carry none of its rows while the idle slot's position
// moved past them. Run returns a permanent error naming the publication
// and the fix within a status interval or so; it used to go on reading
// forever, publishing nothing the producers wrote.
func TestPublicationWithoutTheTableIsRefused(t *testing.T) {
	e := newEnv(t)
	e.createSlot()
	pub := &recorder{}
	r := e.start(pub, e.opts())
	waitFor(t, 10*time.Second, "the relay to hold the slot", r.r.Holding)
	table := pgx.Identifier{e.cfg.Schema, e.cfg.Table}.Sanitize()
	if _, err := e.pool.Exec(context.Background(), "ALTER PUBLICATION "+pgx.Identifier{e.slot.Publication}.Sanitize()+" DROP TABLE "+table); err != nil {
		t.Fatal(err)
	}
	err := runErr(t, r, 10*time.Second)
	if !errors.Is(err, logrelay.ErrNotPublished) || !strings.Contains(err.Error(), e.slot.Publication) || !strings.Contains(err.Error(), "ADD TABLE") {
		t.Fatalf("Run = %v, want ErrNotPublished naming the publication and the fix", err)
	}
	// A relay started on it refuses at once.
	again := e.start(pub, e.opts())
	if err := runErr(t, again, 10*time.Second); !errors.Is(err, logrelay.ErrNotPublished) {
		t.Fatalf("second Run = %v, want ErrNotPublished", err)
	}
}

// A publication with a row filter or a column list on the outbox table
// (PostgreSQL 15+) is refused at start, naming it: the stream would skip
// the rows the filter drops, or carry rows without the columns the relay
// reads, and the slot's position would move past them. It used to be
// read as if it published the whole table.
func TestFilteredPublicationIsRefused(t *testing.T) {
	for name, set := range map[string]string{
		"row filter":  " WHERE (aggregate_id <> 'skipped')",
		"column list": " (seq, event_id, aggregate_id, type, payload)",
	} {
		t.Run(strings.ReplaceAll(name, " ", "_"), func(t *testing.T) {
			e := newEnv(t)
			var version int
			if err := e.pool.QueryRow(context.Background(), "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
				t.Fatal(err)
			}
			if version < 150000 {
				t.Skip("row filters and column lists came with PostgreSQL 15: no publication of this server can have one")
			}
			e.createSlot()
			table := pgx.Identifier{e.cfg.Schema, e.cfg.Table}.Sanitize()
			if _, err := e.pool.Exec(context.Background(), "ALTER PUBLICATION "+pgx.Identifier{e.slot.Publication}.Sanitize()+" SET TABLE "+table+set); err != nil {
				t.Fatal(err)
			}
			r := e.start(&recorder{}, e.opts())
			err := runErr(t, r, 10*time.Second)
			if !errors.Is(err, logrelay.ErrPublicationFiltered) || !strings.Contains(err.Error(), e.slot.Publication) || !strings.Contains(err.Error(), name) {
				t.Fatalf("Run = %v, want ErrPublicationFiltered naming the publication and the %s", err, name)
			}
		})
	}
}

// An invalidated slot (wal_status lost) is a permanent error naming the
// slot and what to do, not a transient one retried forever. A real
// invalidation needs max_slot_wal_keep_size lowered for the whole server,
// which would endanger the slots of tests running beside this one; the
// relay's sessions see instead, through their search_path, a
// pg_replication_slots that reports the slot lost.
func TestLostSlotIsRefused(t *testing.T) {
	e := newEnv(t)
	e.createSlot()
	ctx := context.Background()
	schema := pgx.Identifier{e.cfg.Schema}.Sanitize()
	if _, err := e.pool.Exec(ctx, "CREATE VIEW "+schema+".pg_replication_slots AS SELECT slot_name, plugin, database, confirmed_flush_lsn, 'lost'::text AS wal_status FROM pg_catalog.pg_replication_slots"); err != nil {
		t.Fatal(err)
	}
	pc := e.pool.Config().Copy()
	pc.ConnConfig.RuntimeParams["search_path"] = e.cfg.Schema + ", pg_catalog"
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	r := startRelay(t, pool, &recorder{}, e.opts())
	err = runErr(t, r, 10*time.Second)
	if !errors.Is(err, logrelay.ErrSlotLost) || !strings.Contains(err.Error(), e.slot.Name) || !strings.Contains(err.Error(), "outbox slot create") {
		t.Fatalf("Run = %v, want ErrSlotLost naming the slot and the fix", err)
	}
}

// The receive deadline stays honest under back-pressure: a broker outage
// holds reading, and the replication connection goes dead meanwhile
// (black-holed, so no error ever comes from the socket). When the broker
// returns and reading resumes, the silence since the last message counts,
// so the relay drops the connection at its first empty receive instead of
// a whole ReceiveTimeout later (the clock used to restart with every
// back-pressured wait, and a connection dead during a long outage
// looked alive).
func TestDeadConnectionNoticedAfterBackPressure(t *testing.T) {
	e := newEnv(t)
	e.createSlot()
	cut, proxy := proxiedPool(t)
	var down atomic.Bool
	down.Store(true)
	pub := &recorder{fail: func(*core.Event) error {
		if down.Load() {
			return errors.New("connection refused")
		}
		return nil
	}}
	o := e.opts()
	o.MaxInFlight = 3
	o.ReceiveTimeout = 4 * time.Second
	o.HandOffAfter = -1
	// The server's own 60s: it must not end the connection first (the
	// proxy would pass that on as an error).
	o.WALSenderTimeout = -1
	r := startRelay(t, cut, pub, o)
	waitFor(t, 10*time.Second, "the relay to hold the slot", r.r.Holding)
	for i := range 5 {
		e.write(false, uuid.NewString(), i, 1)
	}
	waitFor(t, 10*time.Second, "back-pressure", func() bool { return r.r.InFlight() == 3 })
	proxy.SetMode(brokertest.BlackHole)
	time.Sleep(o.ReceiveTimeout + time.Second)
	up := time.Now()
	down.Store(false)
	waitFor(t, 10*time.Second, "the relay to drop the dead connection", func() bool { return !r.r.Holding() })
	noticed := time.Since(up)
	proxy.Heal()
	t.Logf("dead connection dropped %s after reading resumed (receive timeout %s)", noticed.Round(10*time.Millisecond), o.ReceiveTimeout)
	// The first empty receive comes within confirmEvery (100ms) of the
	// lanes finishing; 2s leaves a loaded machine room and stays well
	// under the 4s a restarted clock needs.
	if noticed > 2*time.Second {
		t.Fatalf("dead connection noticed %s after reading resumed, want within 2s", noticed)
	}
}
