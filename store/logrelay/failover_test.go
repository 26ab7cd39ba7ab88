package logrelay_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outboxhq/outbox/store/logrelay"
)

// serverVersion is the test server's server_version_num.
func (e *env) serverVersion() int {
	e.t.Helper()
	var v int
	if err := e.pool.QueryRow(context.Background(), "SELECT current_setting('server_version_num')::int").Scan(&v); err != nil {
		e.t.Fatal(err)
	}
	return v
}

// On PostgreSQL 17 and later the slot is a failover slot, which a standby
// with sync_replication_slots keeps, so a promoted standby has it. It was
// created with failover off (copied from a temporary slot, which cannot
// have it).
func TestCreateSlotMakesAFailoverSlot(t *testing.T) {
	e := newEnv(t)
	e.createSlot()
	st := e.status()
	if capable := e.serverVersion() >= 170000; st.FailoverCapable != capable {
		t.Fatalf("FailoverCapable = %v on server_version_num %d", st.FailoverCapable, e.serverVersion())
	}
	if st.Failover != st.FailoverCapable {
		t.Fatalf("slot created with failover %v on a server with failover slots: %v", st.Failover, st.FailoverCapable)
	}
}

// A slot an earlier version created without failover becomes a failover
// slot when a relay starts reading it, and when `outbox slot create` runs
// again while no relay reads it.
func TestExistingSlotBecomesAFailoverSlot(t *testing.T) {
	e := newEnv(t)
	if e.serverVersion() < 170000 {
		t.Skip("failover slots are PostgreSQL 17's")
	}
	ctx := context.Background()
	plain := func() {
		t.Helper()
		e.dropSlot()
		if _, err := e.pool.Exec(ctx, "CREATE PUBLICATION "+pgx.Identifier{e.slot.Publication}.Sanitize()+" FOR TABLE "+
			pgx.Identifier{e.cfg.Schema, e.cfg.Table}.Sanitize()+" WITH (publish = 'insert')"); err != nil {
			t.Fatal(err)
		}
		if _, err := e.pool.Exec(ctx, "SELECT pg_create_logical_replication_slot($1, 'pgoutput')", e.slot.Name); err != nil {
			t.Fatal(err)
		}
		if e.status().Failover {
			t.Fatal("slot made by pg_create_logical_replication_slot is a failover slot")
		}
	}

	plain()
	if c := e.createSlot(); c.Slot {
		t.Fatal("create made a slot that existed")
	}
	if !e.status().Failover {
		t.Fatal("`slot create` left an existing idle slot without failover")
	}

	plain()
	run := e.start(&recorder{}, e.opts())
	waitFor(t, 10*time.Second, "relay reading the slot", run.r.Holding)
	if !e.status().Failover {
		t.Fatal("relay reads a slot without failover")
	}
}

// The relay warns at start when a failover to a standby streaming from
// the primary would lose the slot (before PostgreSQL 17) or events
// (17 and later without synchronized_standby_slots). The standby here is
// a physical replication connection streaming WAL, as a standby's
// walreceiver does.
func TestFailoverWarningsWithAStandby(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	var synced string
	if err := e.pool.QueryRow(ctx, "SELECT coalesce(current_setting('synchronized_standby_slots', true), '')").Scan(&synced); err != nil {
		t.Fatal(err)
	}
	if synced != "" {
		t.Skipf("the test server has synchronized_standby_slots = %q", synced)
	}
	// No standby: nothing to warn about. (Other tests' physical streams
	// would count too; none of this package opens one but this test.)
	if ws, err := logrelay.FailoverWarnings(ctx, e.pool); err != nil || len(ws) != 0 {
		t.Fatalf("FailoverWarnings without a standby = %q, %v", ws, err)
	}

	cfg := e.pool.Config().ConnConfig.Config.Copy()
	if cfg.RuntimeParams == nil {
		cfg.RuntimeParams = map[string]string{}
	}
	cfg.RuntimeParams["replication"] = "true"
	standby, err := pgconn.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = standby.Close(context.Background()) })
	sys, err := pglogrepl.IdentifySystem(ctx, standby)
	if err != nil {
		t.Fatal(err)
	}
	slot := fmt.Sprintf("outbox_test_standby_%d", standby.PID())
	if _, err := pglogrepl.CreateReplicationSlot(ctx, standby, slot, "",
		pglogrepl.CreateReplicationSlotOptions{Temporary: true, Mode: pglogrepl.PhysicalReplication}); err != nil {
		t.Fatal(err)
	}
	if err := pglogrepl.StartReplication(ctx, standby, slot, sys.XLogPos, pglogrepl.StartReplicationOptions{Mode: pglogrepl.PhysicalReplication}); err != nil {
		t.Fatal(err)
	}
	var ws []string
	waitFor(t, 10*time.Second, "a warning with the standby streaming", func() bool {
		ws, err = logrelay.FailoverWarnings(ctx, e.pool)
		if err != nil {
			t.Fatal(err)
		}
		return len(ws) > 0
	})
	want := "synchronized_standby_slots is empty"
	if e.serverVersion() < 170000 {
		want = "keeps logical replication slots on the primary only"
	}
	if len(ws) != 1 || !strings.Contains(ws[0], want) {
		t.Fatalf("FailoverWarnings = %q, want one saying %q", ws, want)
	}
}
