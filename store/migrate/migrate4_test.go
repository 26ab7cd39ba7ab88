package migrate_test

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/core/event"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/admin"
	"github.com/outboxhq/outbox/store/migrate"
)

// The seed article's insert works: a producer names only the columns it
// must, and the row gets a time-ordered uid.
func TestSQLInsertGetsUUIDv7(t *testing.T) {
	ctx := context.Background()
	pool, cfg := pgtest.Schema(t)
	before := time.Now().Add(-time.Second)
	var uid string
	err := pool.QueryRow(ctx, `INSERT INTO `+ident(cfg)+` (aggregate_id, type, payload)
VALUES ('0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0d', 'order.placed', '{"total": 10}') RETURNING event_id::text`).Scan(&uid)
	if err != nil {
		t.Fatalf("the seed article's insert: %v", err)
	}
	u, err := uuid.Parse(uid)
	if err != nil {
		t.Fatal(err)
	}
	if u.Version() != 7 || u.Variant() != uuid.RFC4122 {
		t.Fatalf("uid %s is version %d variant %v, want 7 RFC 4122", uid, u.Version(), u.Variant())
	}
	sec, nsec := u.Time().UnixTime()
	if at := time.Unix(sec, nsec); at.Before(before) || at.After(time.Now().Add(time.Second)) {
		t.Fatalf("uid %s carries time %v, want about now", uid, at)
	}
}

// The database refuses at insert time what the relay could never publish,
// and two rows with one uid.
func TestTableRefusesBadRows(t *testing.T) {
	ctx := context.Background()
	pool, cfg := pgtest.Schema(t)
	agg := uuid.NewString()
	dup := uuid.NewString()
	if _, err := pool.Exec(ctx, `INSERT INTO `+ident(cfg)+` (event_id, aggregate_id, type, payload) VALUES ($1, $2, 'a.b', '{}')`, dup, agg); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name, uid, typ, headers, constraint string
	}{
		{"headers number", "", "a.b", `{"n":1}`, "_headers_check"},
		{"headers array", "", "a.b", `[1,2]`, "_headers_check"},
		{"headers string", "", "a.b", `"abc"`, "_headers_check"},
		{"headers too large", "", "a.b", `{"k":"` + strings.Repeat("v", event.MaxHeadersBytes) + `"}`, "_headers_check"},
		{"type empty", "", "", "", "_type_check"},
		{"type space", "", "order placed", "", "_type_check"},
		{"type tab", "", "order\tplaced", "", "_type_check"},
		{"type control", "", "order\x7fplaced", "", "_type_check"},
		{"type long", "", strings.Repeat("t", 256), "", "_type_check"},
		{"duplicate uid", dup, "a.b", "", "_uid"},
	} {
		t.Run(c.name, func(t *testing.T) {
			var uid, headers any
			if c.uid != "" {
				uid = c.uid
			}
			if c.headers != "" {
				headers = c.headers
			}
			_, err := pool.Exec(ctx, `INSERT INTO `+ident(cfg)+` (event_id, aggregate_id, type, payload, headers)
VALUES (coalesce($1::uuid, `+pgx.Identifier{cfg.Schema, "events_outbox_uuidv7"}.Sanitize()+`()), $2, $3, '{}', $4::jsonb)`, uid, agg, c.typ, headers)
			if err == nil || !strings.Contains(err.Error(), "events_outbox"+c.constraint) {
				t.Fatalf("insert: error %v, want one naming events_outbox%s", err, c.constraint)
			}
		})
	}
	// Good rows still go in, including headers that are an empty object.
	if _, err := pool.Exec(ctx, `INSERT INTO `+ident(cfg)+` (aggregate_id, type, payload, headers) VALUES ($1, 'order.placed', '[]', '{}'), ($1, 'o', '1', NULL)`, agg); err != nil {
		t.Fatal(err)
	}
}

// Upgrading a table that already holds rows the new checks refuse, and
// rows sharing a uid, succeeds: the bad pending rows are held, later
// duplicates get new uids and, when pending, are parked; nothing is lost.
func TestMigration4UpgradesBadRows(t *testing.T) {
	ctx := context.Background()
	pool, cfg := upgradeFrom(t, 3)
	table := ident(cfg)
	dup := uuid.NewString()
	agg := uuid.NewString()
	rows := []struct {
		uid, typ, headers string
		dispatched        bool
	}{
		{dup, "a.b", "", true},          // 1: first of a uid, dispatched
		{dup, "a.b", "", true},          // 2: dispatched duplicate
		{dup, "a.b", "", false},         // 3: pending duplicate
		{"", "bad type", "", false},     // 4: pending, bad type
		{"", "a.b", `{"n":1}`, false},   // 5: pending, bad headers
		{"", "bad type", "", true},      // 6: dispatched, bad type: left alone
		{"", "a.b", `{"k":"v"}`, false}, // 7: good
	}
	ids := make([]int64, len(rows))
	for i, r := range rows {
		uid := r.uid
		if uid == "" {
			uid = uuid.NewString()
		}
		var headers any
		if r.headers != "" {
			headers = r.headers
		}
		var dispatched any
		if r.dispatched {
			dispatched = time.Now()
		}
		err := pool.QueryRow(ctx, `INSERT INTO `+table+` (uid, aggregate_id, type, payload, headers, dispatched_at)
VALUES ($1, $2, $3, '{}', $4::jsonb, $5) RETURNING id`, uid, agg, r.typ, headers, dispatched).Scan(&ids[i])
		if err != nil {
			t.Fatal(err)
		}
	}
	applied, err := migrate.Migrate(ctx, pool, cfg)
	if err != nil {
		t.Fatalf("migrate over bad rows: %v", err)
	}
	if len(applied) == 0 || applied[0] != 4 {
		t.Fatalf("applied %v, want 4 first", applied)
	}
	type state struct {
		uid                   string
		held, parked          bool
		lastError, parkReason string
	}
	got := map[int64]state{}
	r, err := pool.Query(ctx, `SELECT seq, event_id::text, retry_at = 'infinity', parked_at IS NOT NULL, coalesce(last_error, ''), coalesce(parked_reason, '') FROM `+table)
	if err != nil {
		t.Fatal(err)
	}
	for r.Next() {
		var id int64
		var s state
		var held *bool
		if err := r.Scan(&id, &s.uid, &held, &s.parked, &s.lastError, &s.parkReason); err != nil {
			t.Fatal(err)
		}
		s.held = held != nil && *held
		got[id] = s
	}
	if err := r.Err(); err != nil {
		t.Fatal(err)
	}
	if len(got) != len(rows) {
		t.Fatalf("%d rows after the migration, want %d", len(got), len(rows))
	}
	if got[ids[0]].uid != dup || got[ids[1]].uid == dup || got[ids[2]].uid == dup {
		t.Errorf("uids after the migration: first %s, dispatched duplicate %s, pending duplicate %s; want only the first to keep %s",
			got[ids[0]].uid, got[ids[1]].uid, got[ids[2]].uid, dup)
	}
	if s := got[ids[2]]; !s.parked || !strings.Contains(s.parkReason, dup) {
		t.Errorf("pending duplicate: parked %v reason %q, want parked naming the uid", s.parked, s.parkReason)
	}
	for _, i := range []int{3, 4} {
		if s := got[ids[i]]; !s.held || !strings.Contains(s.lastError, "cannot relay row") {
			t.Errorf("row %d: held %v reason %q, want held with a reason", i+1, s.held, s.lastError)
		}
	}
	for _, i := range []int{0, 1, 5, 6} {
		if s := got[ids[i]]; s.held || s.parked {
			t.Errorf("row %d was held or parked; want it left alone", i+1)
		}
	}
	// Every row now passes the check, so a DBA can validate it (since
	// migration 12 one check stands for migration 4's two).
	if _, err := pool.Exec(ctx, `ALTER TABLE `+table+` VALIDATE CONSTRAINT events_outbox_row_check`); err != nil {
		t.Errorf("validate the row check: %v", err)
	}
	// An operator can still park a held bad row.
	st, err := admin.New(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if n, err := st.Park(ctx, admin.Selector{Seqs: []int64{ids[3]}}, "bad type"); err != nil || n != 1 {
		t.Fatalf("park a held bad row: %d, %v", n, err)
	}
}

// upgradeFrom returns a schema of its own migrated up to version v, as an
// older release left it.
func upgradeFrom(t *testing.T, v int) (*pgxpool.Pool, store.Config) {
	t.Helper()
	pool := pgtest.NewPool(t)
	cfg, err := store.Config{Schema: "test_m" + strconv.Itoa(v) + "_" + strings.ReplaceAll(uuid.NewString(), "-", "")[:10]}.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{cfg.Schema}.Sanitize()+" CASCADE")
	})
	migrateTo(context.Background(), t, pool, cfg, v)
	return pool, cfg
}

// migrateTo applies the migrations up to version v, as an older release
// would have.
func migrateTo(ctx context.Context, t *testing.T, pool *pgxpool.Pool, cfg store.Config, v int) {
	t.Helper()
	if _, err := migrate.MigrateWith(ctx, pool, cfg, migrate.Options{To: v}); err != nil {
		t.Fatalf("migrate to version %d: %v", v, err)
	}
}
