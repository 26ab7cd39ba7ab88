package migrate_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/dedupe"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/migrate"
	"github.com/outboxhq/outbox/store/table"
)

func TestGrantsQuoteEveryName(t *testing.T) {
	evil := `x"; DROP TABLE canary; --`
	stmts, err := migrate.Grants(store.Config{Schema: evil, Table: evil + "t"}, migrate.Roles{Relay: evil, LogMode: true, Producer: "p", Consumer: "c"})
	if err != nil {
		t.Fatal(err)
	}
	if len(stmts) != 22 {
		t.Errorf("%d statements, want 22: %q", len(stmts), stmts)
	}
	// With every correctly quoted name taken out, only keywords are left.
	names := []string{
		pgx.Identifier{evil, evil + "t_handoff"}.Sanitize(),
		pgx.Identifier{evil, evil + "t_log_slot"}.Sanitize(),
		pgx.Identifier{evil, evil + "t_log_write"}.Sanitize() + "(text)",
		pgx.Identifier{evil, evil + "t"}.Sanitize(),
		pgx.Identifier{evil, evil + "t_migrations"}.Sanitize(),
		pgx.Identifier{evil, evil + "t_id_seq"}.Sanitize(),
		pgx.Identifier{evil, evil + "t_uuidv7"}.Sanitize() + "()",
		pgx.Identifier{evil, evil + "t_check_row"}.Sanitize() + "(boolean, text, text, boolean, boolean, text, text, timestamptz, jsonb)",
		pgx.Identifier{evil, evil + "t_write"}.Sanitize() + "(text, text, bytea, jsonb, text, text, timestamptz, uuid)",
		pgx.Identifier{evil, evil + "t_write"}.Sanitize() + "(text, text, text, jsonb, text, text, timestamptz, uuid)",
		pgx.Identifier{evil, evil + "t_write"}.Sanitize() + "(text, text, json, jsonb, text, text, timestamptz, uuid)",
		pgx.Identifier{evil, evil + "t_write"}.Sanitize() + "(text, text, jsonb, jsonb, text, text, timestamptz, uuid)",
		pgx.Identifier{evil, "processed_events"}.Sanitize(),
		pgx.Identifier{evil}.Sanitize(), `"p"`, `"c"`,
	}
	shape := regexp.MustCompile(`^GRANT [A-Z, ]+ ON (SCHEMA|TABLE|SEQUENCE|FUNCTION)  TO $`)
	for _, s := range stmts {
		rest := s
		for _, n := range names {
			rest = strings.ReplaceAll(rest, n, "")
		}
		if !shape.MatchString(rest) {
			t.Errorf("statement %q leaves %q outside quoted names", s, rest)
		}
	}
}

func TestGrantsRejectBadInput(t *testing.T) {
	for name, r := range map[string]migrate.Roles{
		"no role":      {},
		"long role":    {Relay: strings.Repeat("r", 64)},
		"NUL in role":  {Producer: "a\x00b"},
		"invalid utf8": {Consumer: "\xff"},
	} {
		if _, err := migrate.Grants(store.Config{}, r); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
	if _, err := migrate.Grants(store.Config{Table: strings.Repeat("t", 48)}, migrate.Roles{Relay: "r"}); err == nil {
		t.Error("a bad table name passed")
	}
}

// roleFixture is an outbox schema and three login roles granted by
// ApplyGrants, each with its own pool.
type roleFixture struct {
	admin                     *pgxpool.Pool
	cfg                       store.Config
	relay, producer, consumer *pgxpool.Pool
}

func newRoleFixture(t *testing.T, noRetention, logMode bool) *roleFixture {
	t.Helper()
	ctx := context.Background()
	admin, cfg := pgtest.Schema(t)
	cfg, err := cfg.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	suffix := randomSuffix()
	// A quote in a role name checks the quoting against a real server.
	names := map[string]string{
		"relay":    `outbox relay "` + suffix,
		"producer": "outbox_producer_" + suffix,
		"consumer": "outbox_consumer_" + suffix,
	}
	pools := map[string]*pgxpool.Pool{}
	for job, role := range names {
		password := "pw-" + randomSuffix()
		if _, err := admin.Exec(ctx, "CREATE ROLE "+pgx.Identifier{role}.Sanitize()+" LOGIN PASSWORD '"+password+"'"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			for _, s := range []string{"DROP OWNED BY ", "DROP ROLE "} {
				if _, err := admin.Exec(context.Background(), s+pgx.Identifier{role}.Sanitize()); err != nil {
					t.Logf("%s%s: %v", s, role, err)
				}
			}
		})
		pc, err := pgxpool.ParseConfig(pgtest.URL(t))
		if err != nil {
			t.Fatal(err)
		}
		pc.ConnConfig.User, pc.ConnConfig.Password = role, password
		pc.ConnConfig.RuntimeParams["application_name"] = "grants-test-" + job
		pool, err := pgxpool.NewWithConfig(ctx, pc)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close) // runs before the role is dropped
		pools[job] = pool
	}
	// As a hardened database does: no function runs for PUBLIC, so the
	// grants must name every function the roles' statements call.
	if _, err := admin.Exec(ctx, "REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA "+pgx.Identifier{cfg.Schema}.Sanitize()+" FROM PUBLIC"); err != nil {
		t.Fatal(err)
	}
	err = migrate.ApplyGrants(ctx, admin, cfg, migrate.Roles{
		Relay: names["relay"], Producer: names["producer"], Consumer: names["consumer"], NoRetention: noRetention, LogMode: logMode,
	})
	if err != nil {
		t.Fatal(err)
	}
	return &roleFixture{admin: admin, cfg: cfg, relay: pools["relay"], producer: pools["producer"], consumer: pools["consumer"]}
}

func (f *roleFixture) table() string {
	return pgx.Identifier{f.cfg.Schema, f.cfg.Table}.Sanitize()
}

func randomSuffix() string {
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// mustDeny fails unless err is PostgreSQL's insufficient_privilege (or,
// for DROP, must_be_owner, which has the same code).
func mustDeny(t *testing.T, what string, err error) {
	t.Helper()
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
		t.Errorf("%s: want permission denied, got %v", what, err)
	}
}

func TestLeastPrivilegeRoles(t *testing.T) {
	f := newRoleFixture(t, false, false)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	agg := uuid.NewString()

	// Producer: writes events, in its own transaction, and can do nothing else.
	w, err := outbox.NewWriter(outbox.WriterOptions{Store: f.cfg})
	if err != nil {
		t.Fatal(err)
	}
	err = pgx.BeginFunc(ctx, f.producer, func(tx pgx.Tx) error {
		return w.Write(ctx, tx,
			outbox.Message{AggregateID: agg, Type: "order.placed", Payload: map[string]int{"n": 1}},
			outbox.Message{AggregateID: agg, Type: "order.paid", Payload: map[string]int{"n": 2}})
	})
	if err != nil {
		t.Fatalf("producer write: %v", err)
	}
	// The write function and the schedule trigger run under the
	// producer's grants too; rolled back, so the counts below stay.
	tx, err := f.producer.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, err = tx.Exec(ctx, "SELECT "+pgx.Identifier{f.cfg.Schema, f.cfg.Table + "_write"}.Sanitize()+
		"('k', 't.x', '\\x00'::bytea, content_type => 'application/octet-stream', deliver_at => now() + interval '1 hour')")
	_ = tx.Rollback(ctx)
	if err != nil {
		t.Fatalf("producer calls the write function: %v", err)
	}
	_, err = f.producer.Exec(ctx, "SELECT payload FROM "+f.table())
	mustDeny(t, "producer reads payloads", err)
	_, err = f.producer.Exec(ctx, "UPDATE "+f.table()+" SET dispatched_at = now()")
	mustDeny(t, "producer marks events", err)
	_, err = f.producer.Exec(ctx, "DELETE FROM "+f.table())
	mustDeny(t, "producer deletes events", err)

	// Relay: checks the schema, claims and marks.
	if err := migrate.CheckSchema(ctx, f.relay, f.cfg); err != nil {
		t.Fatalf("relay schema check: %v", err)
	}
	st, err := table.New(f.relay, f.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, unordered := range []bool{false, true} {
		c, err := st.Claim(ctx, core.ClaimOptions{Limit: 10, Unordered: unordered})
		if err != nil {
			t.Fatalf("relay claim (unordered %v): %v", unordered, err)
		}
		if len(c.Events()) != 2 {
			t.Fatalf("relay claimed %d events, want 2", len(c.Events()))
		}
		if unordered {
			ids := []int64{c.Events()[0].Seq, c.Events()[1].Seq}
			if err := c.Complete(ctx, ids[:1], []core.Failure{{Seq: ids[1], Reason: "test", RetryAt: time.Now()}}); err != nil {
				t.Fatalf("relay complete: %v", err)
			}
		} else if err := c.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	var dispatched int
	if err := f.admin.QueryRow(ctx, "SELECT count(*) FROM "+f.table()+" WHERE dispatched_at IS NOT NULL").Scan(&dispatched); err != nil {
		t.Fatal(err)
	}
	if dispatched != 1 {
		t.Fatalf("%d events dispatched, want 1", dispatched)
	}
	// Retention's deletes, on both tables.
	if _, err := f.relay.Exec(ctx, "DELETE FROM "+f.table()+" WHERE dispatched_at < now() - interval '1 day'"); err != nil {
		t.Errorf("relay retention delete: %v", err)
	}
	processed := pgx.Identifier{f.cfg.Schema, "processed_events"}.Sanitize()
	if _, err := f.relay.Exec(ctx, "DELETE FROM "+processed+" WHERE (consumer, event_id) IN (SELECT consumer, event_id FROM "+
		processed+" WHERE processed_at < now() - interval '1 day' FOR UPDATE SKIP LOCKED)"); err != nil {
		t.Errorf("relay processed retention delete: %v", err)
	}
	// In table mode the relay never inserts, so it may not.
	_, err = f.relay.Exec(ctx, "INSERT INTO "+f.table()+" (event_id, aggregate_id, type, payload) VALUES ($1, 'k', 't', '{}')", uuid.NewString())
	mustDeny(t, "relay in table mode inserts an event", err)
	_, err = f.relay.Exec(ctx, "SELECT * FROM "+pgx.Identifier{f.cfg.Schema, f.cfg.Table + "_handoff"}.Sanitize())
	mustDeny(t, "relay in table mode reads the handoff view", err)
	_, err = f.relay.Exec(ctx, "DROP TABLE "+f.table())
	mustDeny(t, "relay drops the outbox", err)
	_, err = f.relay.Exec(ctx, "TRUNCATE "+f.table())
	mustDeny(t, "relay truncates the outbox", err)
	_, err = f.relay.Exec(ctx, "CREATE TABLE "+pgx.Identifier{f.cfg.Schema, "intruder"}.Sanitize()+" (x int)")
	mustDeny(t, "relay creates a table", err)
	_, err = f.relay.Exec(ctx, "INSERT INTO "+processed+" (consumer, event_id) VALUES ('x', 'y')")
	mustDeny(t, "relay records a processed event", err)

	// Consumer: dedupes and cleans up its own records, and cannot read events.
	d, err := dedupe.New(f.consumer, dedupe.Options{Consumer: "grants-test", Store: f.cfg})
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range []bool{true, false} {
		applied, err := d.Process(ctx, "event-1", func(context.Context, pgx.Tx) error { return nil })
		if err != nil || applied != want {
			t.Fatalf("consumer process #%d: applied %v, %v; want %v", i+1, applied, err, want)
		}
	}
	if _, err := d.Cleanup(ctx, time.Hour, 100); err != nil {
		t.Errorf("consumer cleanup: %v", err)
	}
	_, err = f.consumer.Exec(ctx, "SELECT payload FROM "+f.table())
	mustDeny(t, "consumer reads the outbox", err)
}

func TestLeastPrivilegeWithoutRetention(t *testing.T) {
	f := newRoleFixture(t, true, false)
	ctx := context.Background()
	st, err := table.New(f.relay, f.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	c, err := st.Claim(ctx, core.ClaimOptions{Limit: 10})
	if err != nil {
		t.Fatalf("relay claim: %v", err)
	}
	if err := c.Release(ctx); err != nil {
		t.Fatal(err)
	}
	_, err = f.relay.Exec(ctx, "DELETE FROM "+f.table())
	mustDeny(t, "relay without retention deletes events", err)
	_, err = f.relay.Exec(ctx, "DELETE FROM "+pgx.Identifier{f.cfg.Schema, "processed_events"}.Sanitize())
	mustDeny(t, "relay without retention deletes processed records", err)
}

// relay.mode log: the relay also hands log-only events to the table and
// claims them through the handoff view.
func TestLeastPrivilegeLogMode(t *testing.T) {
	f := newRoleFixture(t, false, true)
	ctx := context.Background()
	if _, err := f.relay.Exec(ctx, "INSERT INTO "+f.table()+" (event_id, aggregate_id, type, payload, handoff_at) VALUES ($1, 'k', 't', '{}', now())", uuid.NewString()); err != nil {
		t.Errorf("relay hands an event to the table: %v", err)
	}
	hst, err := table.NewHandOff(f.relay, f.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	c, err := hst.Claim(ctx, core.ClaimOptions{Limit: 10})
	if err != nil {
		t.Fatalf("relay claims the handoff view: %v", err)
	}
	if len(c.Events()) != 1 {
		t.Errorf("claimed %d handed-off events, want 1", len(c.Events()))
	}
	if err := c.Complete(ctx, []int64{c.Events()[0].Seq}, nil); err != nil {
		t.Errorf("relay marks a handed-off event: %v", err)
	}
	// The relay records the slot it reads; a producer's log-only write
	// reads the record (and is refused here only because no such slot
	// exists).
	cfg, err := f.cfg.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	slots := cfg.Names().LogSlot
	if _, err := f.relay.Exec(ctx, `INSERT INTO `+slots+` AS s (slot_name, publication) VALUES ('no_such_slot', 'no_such_publication')
ON CONFLICT (one) DO UPDATE SET slot_name = excluded.slot_name, publication = excluded.publication`); err != nil {
		t.Errorf("relay records its slot: %v", err)
	}
	if _, err := f.relay.Exec(ctx, `UPDATE `+slots+` SET confirmed_lsn = '0/1000' WHERE slot_name = 'no_such_slot'`); err != nil {
		t.Errorf("relay records its position: %v", err)
	}
	var lsn string
	if err := f.relay.QueryRow(ctx, `SELECT confirmed_lsn::text FROM `+slots+` WHERE slot_name = 'no_such_slot'`).Scan(&lsn); err != nil || lsn != "0/1000" {
		t.Errorf("relay reads its position: %q, %v", lsn, err)
	}
	fn, err := f.cfg.LogWriteFunc()
	if err != nil {
		t.Fatal(err)
	}
	_, err = f.producer.Exec(ctx, "SELECT "+fn+"('{}')")
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "55000" {
		t.Errorf("producer's log-only write without a slot: %v, want refused for the slot (55000), not for privileges", err)
	}
}
