package migrate_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/migrate"
)

// schemaOf describes every object of the schema, with the schema's name
// replaced, as lines in a stable order: columns in table order with type,
// collation, nullability and default; constraints with their definition
// and whether they are validated; indexes with definition and validity;
// triggers, functions, views and sequences; and the migrations recorded.
func schemaOf(ctx context.Context, t *testing.T, pool *pgxpool.Pool, schema string) []string {
	t.Helper()
	rows, err := pool.Query(ctx, `
SELECT 'column ' || c.relname || ' #' || row_number() OVER (PARTITION BY c.oid ORDER BY a.attnum) || ' ' || a.attname || ' ' ||
       format_type(a.atttypid, a.atttypmod) ||
       CASE WHEN a.attcollation <> 0 AND a.attcollation <> t.typcollation THEN ' collate ' || co.collname ELSE '' END ||
       CASE WHEN a.attnotnull THEN ' not null' ELSE '' END || coalesce(' default ' || pg_get_expr(d.adbin, d.adrelid), '')
FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid JOIN pg_type t ON t.oid = a.atttypid
LEFT JOIN pg_collation co ON co.oid = a.attcollation
LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE c.relnamespace = $1::regnamespace AND c.relkind IN ('r', 'v') AND a.attnum > 0 AND NOT a.attisdropped
UNION ALL
SELECT 'constraint ' || conrelid::regclass::text || ' ' || conname || ' ' || pg_get_constraintdef(oid) || ' validated ' || convalidated
FROM pg_constraint WHERE connamespace = $1::regnamespace
UNION ALL
SELECT 'index ' || pg_get_indexdef(i.indexrelid) || ' valid ' || i.indisvalid
FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relnamespace = $1::regnamespace
UNION ALL
SELECT 'trigger ' || pg_get_triggerdef(tg.oid) || ' enabled ' || tg.tgenabled::text
FROM pg_trigger tg JOIN pg_class c ON c.oid = tg.tgrelid WHERE c.relnamespace = $1::regnamespace AND NOT tg.tgisinternal
UNION ALL
SELECT 'function ' || pg_get_functiondef(p.oid) FROM pg_proc p WHERE p.pronamespace = $1::regnamespace
UNION ALL
SELECT 'view ' || c.relname || ' ' || pg_get_viewdef(c.oid) FROM pg_class c WHERE c.relnamespace = $1::regnamespace AND c.relkind = 'v'
UNION ALL
SELECT 'relation ' || c.relname || ' ' || c.relkind::text || ' ' || c.relpersistence::text FROM pg_class c WHERE c.relnamespace = $1::regnamespace`, schema)
	if err != nil {
		t.Fatal(err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	var versions []string
	if err := pool.QueryRow(ctx, `SELECT array_agg(version || '/' || coalesce(step::text, 'done') ORDER BY version)::text[] FROM `+
		pgx.Identifier{schema, "events_outbox_migrations"}.Sanitize()).Scan(&versions); err != nil {
		t.Fatal(err)
	}
	lines = append(lines, "migrations "+strings.Join(versions, " "))
	for i, l := range lines {
		lines[i] = strings.ReplaceAll(l, schema, "SCHEMA")
	}
	sort.Strings(lines)
	return lines
}

func diffLines(a, b []string) string {
	in := func(xs []string) map[string]bool {
		m := map[string]bool{}
		for _, x := range xs {
			m[x] = true
		}
		return m
	}
	ina, inb := in(a), in(b)
	var d []string
	for _, x := range a {
		if !inb[x] {
			d = append(d, "- "+x)
		}
	}
	for _, x := range b {
		if !ina[x] {
			d = append(d, "+ "+x)
		}
	}
	return strings.Join(d, "\n")
}

// A schema upgraded from any earlier version, with rows in it, is the
// schema a fresh migrate makes, object for object.
func TestUpgradedSchemaIsFreshSchema(t *testing.T) {
	ctx := context.Background()
	migs, err := migrate.Migrations(store.Config{})
	if err != nil {
		t.Fatal(err)
	}
	latest := migs[len(migs)-1].Version
	pool, fresh := upgradeFrom(t, latest)
	want := schemaOf(ctx, t, pool, fresh.Schema)
	for v := 1; v < latest; v++ {
		t.Run(fmt.Sprintf("from_%d", v), func(t *testing.T) {
			pool, cfg := upgradeFrom(t, v)
			fillAsVersion(ctx, t, pool, cfg, v, 3000)
			if _, err := migrate.MigrateWith(ctx, pool, cfg, migrate.Options{BatchRows: 1000}); err != nil {
				t.Fatal(err)
			}
			if d := diffLines(want, schemaOf(ctx, t, pool, cfg.Schema)); d != "" {
				t.Errorf("schema upgraded from %d differs from a fresh one:\n%s", v, d)
			}
		})
	}
}

// stopAfter is a log handler that cancels a migration once it logs that a
// given step is applied: the step is recorded, the next one never starts,
// as when the process is killed between them.
type stopAfter struct {
	version, step int
	cancel        context.CancelFunc
	mu            *sync.Mutex
	msgs          *[]string
}

func (h stopAfter) Enabled(context.Context, slog.Level) bool { return true }
func (h stopAfter) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h stopAfter) WithGroup(string) slog.Handler            { return h }
func (h stopAfter) Handle(_ context.Context, r slog.Record) error {
	var v, s int64
	r.Attrs(func(a slog.Attr) bool {
		switch a.Key {
		case "version":
			v = a.Value.Int64()
		case "step":
			s = a.Value.Int64()
		}
		return true
	})
	h.mu.Lock()
	*h.msgs = append(*h.msgs, r.Message)
	h.mu.Unlock()
	if r.Message == "migration step applied" && int(v) == h.version && int(s) == h.step {
		h.cancel()
	}
	return nil
}

// A migration stopped after any of its steps resumes at the next one: the
// version row says how far it got, the relay's schema check refuses the
// half-done schema, producers of the version before keep writing, and the
// finished schema is the fresh one.
func TestMigrationResumesAfterEveryStep(t *testing.T) {
	ctx := context.Background()
	cfg0, _ := store.Config{}.WithDefaults()
	migs, err := migrate.Migrations(cfg0)
	if err != nil {
		t.Fatal(err)
	}
	latest := migs[len(migs)-1].Version
	pool, fresh := upgradeFrom(t, latest)
	want := schemaOf(ctx, t, pool, fresh.Schema)
	for _, m := range migs[1:] {
		for step := 1; step < len(m.Steps); step++ {
			t.Run(fmt.Sprintf("%d_step_%d", m.Version, step), func(t *testing.T) {
				pool, cfg := upgradeFrom(t, m.Version-1)
				fillAsVersion(ctx, t, pool, cfg, m.Version-1, 500)
				sctx, cancel := context.WithCancel(ctx)
				defer cancel()
				var mu sync.Mutex
				var msgs []string
				h := stopAfter{version: m.Version, step: step, cancel: cancel, mu: &mu, msgs: &msgs}
				_, err := migrate.MigrateWith(sctx, pool, cfg, migrate.Options{Log: slog.New(h), BatchRows: 100})
				if !errors.Is(err, context.Canceled) {
					t.Fatalf("migrate stopped after step %d: err = %v, want it canceled", step, err)
				}
				have, partial, done, err := migrate.SchemaProgress(ctx, pool, cfg)
				if err != nil || have != m.Version-1 || partial != m.Version || done != step {
					t.Fatalf("progress (%d, %d, %d), %v; want version %d complete, %d at step %d", have, partial, done, err, m.Version-1, m.Version, step)
				}
				if err := migrate.CheckSchema(ctx, pool, cfg); !errors.Is(err, migrate.ErrNotMigrated) || !strings.Contains(err.Error(), "stopped after step") {
					t.Errorf("schema check of a half-done migration: %v", err)
				}
				// The producers of the version before still write.
				q := `INSERT INTO ` + ident(cfg) + ` (uid, aggregate_id, type, payload) VALUES (gen_random_uuid(), $1, 'a.b', '{}')`
				if m.Version > 5 {
					q = `INSERT INTO ` + ident(cfg) + ` (aggregate_id, type, payload) VALUES ($1, 'a.b', '{}')`
				}
				if _, err := pool.Exec(ctx, q, uuid.NewString()); err != nil {
					t.Errorf("producer of version %d mid-migration: %v", m.Version-1, err)
				}
				applied, err := migrate.Migrate(ctx, pool, cfg)
				if err != nil || len(applied) == 0 || applied[0] != m.Version {
					t.Fatalf("resume: applied %v, %v", applied, err)
				}
				if d := diffLines(want, schemaOf(ctx, t, pool, cfg.Schema)); d != "" {
					t.Errorf("schema after resuming differs from a fresh one:\n%s", d)
				}
			})
		}
	}
}

// An index build that failed or was stopped leaves an invalid index;
// the resumed step drops it and builds the index again.
func TestMigrationRebuildsAnInvalidIndex(t *testing.T) {
	ctx := context.Background()
	pool, cfg := upgradeFrom(t, 5)
	fillAsVersion(ctx, t, pool, cfg, 5, 200)
	failed := pgx.Identifier{"events_outbox_failed"}.Sanitize()
	// A unique index on a column with duplicates fails after it is
	// created, as an interrupted build does, and is left invalid.
	_, err := pool.Exec(ctx, "CREATE UNIQUE INDEX CONCURRENTLY "+failed+" ON "+ident(cfg)+" (type)")
	if err == nil {
		t.Fatal("unique index over duplicate types was built")
	}
	if _, err := migrate.Migrate(ctx, pool, cfg); err != nil {
		t.Fatal(err)
	}
	var def string
	var valid bool
	if err := pool.QueryRow(ctx, `SELECT pg_get_indexdef(indexrelid), indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)`,
		pgx.Identifier{cfg.Schema}.Sanitize()+"."+failed).Scan(&def, &valid); err != nil {
		t.Fatal(err)
	}
	if !valid || !strings.Contains(def, "(failed_at)") {
		t.Fatalf("index after migrate: %s, valid %v; want migration 6's, valid", def, valid)
	}
}

// A step whose lock is busy gives up after lock_timeout, so producers
// queued behind it go on, and tries again until the lock is free; with
// its retries used up it fails with an error that says so.
func TestMigrationRetriesABusyLock(t *testing.T) {
	ctx := context.Background()
	pool, cfg := upgradeFrom(t, 5) // next: migration 6 adds a column
	// A long report holds ACCESS SHARE, which ALTER TABLE waits for.
	report, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = report.Rollback(ctx) }()
	if _, err := report.Exec(ctx, "SELECT count(*) FROM "+ident(cfg)); err != nil {
		t.Fatal(err)
	}
	_, err = migrate.MigrateWith(ctx, pool, cfg, migrate.Options{LockTimeout: 50 * time.Millisecond, LockRetries: 1})
	if err == nil || !strings.Contains(err.Error(), "lock still busy after 2 tries") {
		t.Fatalf("migrate with its retries used up: %v", err)
	}

	pctx, stop := context.WithCancel(ctx)
	prod := startProducer(pctx, pool, cfg, 5)
	var mu sync.Mutex
	var msgs []string
	h := stopAfter{mu: &mu, msgs: &msgs, cancel: func() {}}
	done := make(chan error, 1)
	go func() {
		_, err := migrate.MigrateWith(ctx, pool, cfg, migrate.Options{LockTimeout: 100 * time.Millisecond, Log: slog.New(h)})
		done <- err
	}()
	time.Sleep(2 * time.Second)
	if err := report.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	err = <-done
	time.Sleep(200 * time.Millisecond)
	stop()
	res := prod.wait()
	if err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	retries := 0
	for _, m := range msgs {
		if strings.Contains(m, "trying again") {
			retries++
		}
	}
	mu.Unlock()
	if retries == 0 {
		t.Errorf("no retry logged while the lock was held: %q", msgs)
	}
	// The bound: 100ms of lock_timeout per try, with room for a loaded
	// machine; without it every insert would wait the two seconds.
	if res.max > time.Second || len(res.errs) > 0 || res.inserts < 50 {
		t.Errorf("producer during the retries: %d inserts, max wait %v, errors %v", res.inserts, res.max, res.errs)
	}
	t.Logf("%d retries; producer: %d inserts, max wait %v", retries, res.inserts, res.max)
}

// The migrations themselves keep write locks short: after the first
// (which creates the tables), a statement whose lock blocks INSERT runs
// in a transaction step (so under lock_timeout, retried) and is a catalog
// change: no index built without CONCURRENTLY, no column retyped, no
// check added without NOT VALID. An index built concurrently is named and
// IF NOT EXISTS, so a resumed build finds it.
func TestMigrationsTakeNoLongWriteLock(t *testing.T) {
	migs, err := migrate.Migrations(store.Config{})
	if err != nil {
		t.Fatal(err)
	}
	long := []*regexp.Regexp{
		regexp.MustCompile(`^CREATE (UNIQUE )?INDEX (?:[^C]|C[^O])`),
		regexp.MustCompile(`\bTYPE\b`),
		regexp.MustCompile(`^VACUUM FULL|^CLUSTER|^REINDEX`),
	}
	// A column added with a default rewrites the table, unless the
	// default is a constant: PostgreSQL 11 and later keep that in the
	// catalog.
	addDefault := regexp.MustCompile(`ADD COLUMN [^,]*\bDEFAULT\s+([^,\s]+)`)
	constant := regexp.MustCompile(`^(-?[0-9]+|'[^']*'|true|false|NULL)$`)
	concurrent := regexp.MustCompile(`^CREATE (UNIQUE )?INDEX CONCURRENTLY IF NOT EXISTS "`)
	for _, m := range migs[1:] {
		for i, s := range m.Steps {
			for _, st := range s.Statements {
				flat := strings.Join(strings.Fields(stripComments(st.SQL)), " ")
				if strings.HasPrefix(flat, "CREATE FUNCTION") {
					continue
				}
				if st.Lock.BlocksWrites && s.Kind != migrate.StepTx {
					t.Errorf("%04d step %d: %.60q blocks writes outside a transaction step", m.Version, i+1, flat)
				}
				for _, re := range long {
					if re.MatchString(flat) {
						t.Errorf("%04d step %d: %.80q holds its lock for a scan or a rewrite (%s)", m.Version, i+1, flat, re)
					}
				}
				for _, d := range addDefault.FindAllStringSubmatch(flat, -1) {
					if !constant.MatchString(d[1]) {
						t.Errorf("%04d step %d: %.80q adds a column with the default %s, which rewrites the table", m.Version, i+1, flat, d[1])
					}
				}
				for _, c := range strings.Split(flat, "ADD CONSTRAINT ")[1:] {
					if !strings.Contains(c, "NOT VALID") {
						t.Errorf("%04d step %d: constraint %.60q is added without NOT VALID: its check scans the table under lock", m.Version, i+1, c)
					}
				}
				if strings.Contains(flat, "CONCURRENTLY") && strings.HasPrefix(flat, "CREATE") && !concurrent.MatchString(flat) {
					t.Errorf("%04d step %d: %.60q: a concurrent build is named and IF NOT EXISTS", m.Version, i+1, flat)
				}
			}
		}
	}
}

func stripComments(sql string) string {
	var b strings.Builder
	for _, l := range strings.Split(sql, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(l), "--") {
			b.WriteString(l + "\n")
		}
	}
	return b.String()
}

// lockStrength orders PostgreSQL's table lock modes, by pg_locks name and
// by the name the migrations print.
var lockStrength = map[string]int{
	"AccessShareLock": 1, "RowShareLock": 2, "RowExclusiveLock": 3, "ShareUpdateExclusiveLock": 4,
	"ShareLock": 5, "ShareRowExclusiveLock": 6, "ExclusiveLock": 7, "AccessExclusiveLock": 8,
	"ACCESS SHARE": 1, "ROW SHARE": 2, "ROW EXCLUSIVE": 3, "SHARE UPDATE EXCLUSIVE": 4,
	"SHARE": 5, "SHARE ROW EXCLUSIVE": 6, "EXCLUSIVE": 7, "ACCESS EXCLUSIVE": 8,
}

// The lock --print names for each statement of a transaction step is the
// one PostgreSQL takes on the outbox: after each statement, the strongest
// lock the transaction holds on the table is the strongest named so far.
func TestStepLocksAreWhatPostgreSQLTakes(t *testing.T) {
	ctx := context.Background()
	pool, cfg := upgradeFrom(t, 1)
	fillAsVersion(ctx, t, pool, cfg, 1, 100)
	migs, err := migrate.Migrations(cfg)
	if err != nil {
		t.Fatal(err)
	}
	table := ident(cfg)
	held := func(tx pgx.Tx) int {
		t.Helper()
		var modes []string
		if err := tx.QueryRow(ctx, `SELECT coalesce(array_agg(mode), '{}') FROM pg_locks
WHERE locktype = 'relation' AND relation = $1::regclass AND pid = pg_backend_pid() AND granted`, table).Scan(&modes); err != nil {
			t.Fatal(err)
		}
		s := 0
		for _, m := range modes {
			s = max(s, lockStrength[m])
		}
		return s
	}
	for _, m := range migs[1:] {
		for i, s := range m.Steps {
			switch s.Kind {
			case migrate.StepTx:
				// Once to look at the locks, rolled back; then for real.
				tx, err := pool.Begin(ctx)
				if err != nil {
					t.Fatal(err)
				}
				named := 0
				for _, st := range s.Statements {
					if _, err := tx.Exec(ctx, st.SQL); err != nil {
						t.Fatalf("%04d step %d: %v", m.Version, i+1, err)
					}
					if !strings.Contains(st.Lock.Note, "on the index") {
						named = max(named, lockStrength[st.Lock.Mode])
					}
					if got := held(tx); got != named {
						t.Errorf("%04d step %d: after %.50q the transaction holds lock strength %d on the outbox, --print names %d (%s)",
							m.Version, i+1, strings.TrimSpace(stripComments(st.SQL)), got, named, st.Lock)
					}
				}
				_ = tx.Rollback(ctx)
				if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					_, err := tx.Exec(ctx, s.SQL())
					return err
				}); err != nil {
					t.Fatal(err)
				}
			case migrate.StepBatch:
				if _, err := pool.Exec(ctx, s.Statements[0].SQL, int64(0), int64(1<<62)); err != nil {
					t.Fatal(err)
				}
			default:
				if _, err := pool.Exec(ctx, s.Statements[0].SQL); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
}

// Names are filled in after the files are split into steps, and quoted
// names never decide a statement's lock: a name that looks like a step
// marker, a comment or a keyword leaves the steps and locks as they are.
func TestMigrationStepsIgnoreNames(t *testing.T) {
	plain, err := migrate.Migrations(store.Config{})
	if err != nil {
		t.Fatal(err)
	}
	odd, err := migrate.Migrations(store.Config{Schema: "s VALIDATE CONSTRAINT x", Table: "t\n--- step batch\n-- ; '", ProcessedTable: "p\"$$"})
	if err != nil {
		t.Fatal(err)
	}
	for i, m := range plain {
		if len(odd[i].Steps) != len(m.Steps) {
			t.Fatalf("%04d: %d steps with odd names, %d without", m.Version, len(odd[i].Steps), len(m.Steps))
		}
		for j, s := range m.Steps {
			o := odd[i].Steps[j]
			if o.Kind != s.Kind || len(o.Statements) != len(s.Statements) {
				t.Fatalf("%04d step %d: %v with %d statements under odd names, %v with %d", m.Version, j+1, o.Kind, len(o.Statements), s.Kind, len(s.Statements))
			}
			for k, st := range s.Statements {
				if o.Statements[k].Lock != st.Lock {
					t.Errorf("%04d step %d statement %d: lock %v under odd names, %v", m.Version, j+1, k+1, o.Statements[k].Lock, st.Lock)
				}
			}
		}
	}
}

// A schema that an earlier release migrated (each migration in one
// transaction, the files of store/testdata/release8, a migrations table
// without the step column) upgrades with the step runner: a relay of this
// release accepts it when complete, the migrations it applied are not run
// again, the others are, and the result is the fresh schema, except that
// a table the earlier migration 7 converted keeps aggregate_id in third
// place. The constraints are compared by name too: from PostgreSQL 18 on a
// NOT NULL is one, named after the column it was set on.
func TestUpgradeSchemaOfEarlierRelease(t *testing.T) {
	ctx := context.Background()
	migs, err := migrate.Migrations(store.Config{})
	if err != nil {
		t.Fatal(err)
	}
	latest := migs[len(migs)-1].Version
	pool, fresh := upgradeFrom(t, latest)
	want := schemaOf(ctx, t, pool, fresh.Schema)
	files, err := filepath.Glob("testdata/release8/*.sql")
	if err != nil || len(files) != 8 {
		t.Fatalf("release files %v, %v", files, err)
	}
	for _, v := range []int{3, 6, 7, 8} {
		t.Run(fmt.Sprintf("at_%d", v), func(t *testing.T) {
			cfg, err := store.Config{Schema: "test_old" + strconv.Itoa(v) + "_" + strings.ReplaceAll(uuid.NewString(), "-", "")[:10]}.WithDefaults()
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{cfg.Schema}.Sanitize()+" CASCADE")
			})
			mt := pgx.Identifier{cfg.Schema, cfg.Table + "_migrations"}.Sanitize()
			stmts := []string{
				"CREATE SCHEMA " + pgx.Identifier{cfg.Schema}.Sanitize(),
				"CREATE TABLE " + mt + " (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())",
			}
			for _, f := range files[:v] {
				raw, err := os.ReadFile(f)
				if err != nil {
					t.Fatal(err)
				}
				sql, err := migrate.RenderMigrationFile(cfg, string(raw))
				if err != nil {
					t.Fatal(err)
				}
				base := strings.TrimSuffix(filepath.Base(f), ".sql")
				num, name, _ := strings.Cut(base, "_")
				n, _ := strconv.Atoi(num)
				stmts = append(stmts, "BEGIN; "+sql+"; INSERT INTO "+mt+" (version, name) VALUES ("+strconv.Itoa(n)+", '"+name+"'); COMMIT")
			}
			for _, s := range stmts {
				if _, err := pool.Exec(ctx, s); err != nil {
					t.Fatalf("%.80s: %v", s, err)
				}
			}
			fillAsVersion(ctx, t, pool, cfg, v, 2000)
			if err := migrate.CheckSchema(ctx, pool, cfg); (err == nil) != (v == latest) {
				t.Errorf("relay's schema check at version %d of an earlier release: %v", v, err)
			}
			applied, err := migrate.MigrateWith(ctx, pool, cfg, migrate.Options{BatchRows: 500})
			if err != nil {
				t.Fatal(err)
			}
			if len(applied) != latest-v || (len(applied) > 0 && applied[0] != v+1) {
				t.Fatalf("applied %v at version %d, want %d to %d", applied, v, v+1, latest)
			}
			if err := migrate.CheckSchema(ctx, pool, cfg); err != nil {
				t.Errorf("relay's schema check after the upgrade from version %d of an earlier release: %v", v, err)
			}
			got, exp := schemaOf(ctx, t, pool, cfg.Schema), want
			if v >= 7 {
				got, exp = withoutColumnOrder(got), withoutColumnOrder(want)
			}
			if d := diffLines(exp, got); d != "" {
				t.Errorf("schema an earlier release took to %d, upgraded, differs from a fresh one:\n%s", v, d)
			}
		})
	}
}

var columnPosition = regexp.MustCompile(`^(column \S+) #\d+ `)

// withoutColumnOrder drops the position of each column, and sorts the
// columns a view selects, which follow the table's order.
func withoutColumnOrder(lines []string) []string {
	out := make([]string, len(lines))
	for i, l := range lines {
		l = columnPosition.ReplaceAllString(l, "$1 ")
		if head, rest, ok := strings.Cut(l, " SELECT "); ok && strings.HasPrefix(l, "view ") {
			if list, from, ok := strings.Cut(rest, "\n   FROM "); ok {
				cols := strings.Split(list, ",")
				for j := range cols {
					cols[j] = strings.TrimSpace(cols[j])
				}
				sort.Strings(cols)
				l = head + " SELECT " + strings.Join(cols, ", ") + " FROM " + from
			}
		}
		out[i] = l
	}
	sort.Strings(out)
	return out
}

func TestMigrateOptionsValidation(t *testing.T) {
	for _, c := range []struct {
		opts  migrate.Options
		field string
	}{
		{migrate.Options{To: -1}, "to is -1"},
		{migrate.Options{LockTimeout: time.Millisecond}, "lock timeout 1ms"},
		{migrate.Options{LockTimeout: time.Minute}, "lock timeout 1m0s"},
		{migrate.Options{LockRetries: -1}, "lock retries -1"},
		{migrate.Options{BatchRows: 10}, "batch rows 10"},
		{migrate.Options{BatchRows: 2_000_000}, "batch rows 2000000"},
	} {
		// Options are checked before the pool is used.
		_, err := migrate.MigrateWith(context.Background(), nil, store.Config{}, c.opts)
		if err == nil || !strings.Contains(err.Error(), c.field) {
			t.Errorf("%+v: err = %v, want one naming %q", c.opts, err, c.field)
		}
	}
}

// Migrations 2 and 3 once let PostgreSQL name their indexes; now that they
// build them concurrently under a name of their own, it is the one
// PostgreSQL chose, for long and multibyte table names too, so a schema an
// earlier release made has them under the same names.
func TestConcurrentIndexesKeepTheNamesPostgreSQLChose(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.NewPool(t)
	schema := "test_names_" + strings.ReplaceAll(uuid.NewString(), "-", "")[:8]
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+quote(schema)+" CASCADE") })
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+quote(schema)); err != nil {
		t.Fatal(err)
	}
	named := regexp.MustCompile(`IF NOT EXISTS ("(?:[^"]|"")+")`)
	for _, table := range []string{"events_outbox", strings.Repeat("t", 47), strings.Repeat("é", 23) + "x", "dispatched_at_and_more_than_that"} {
		cfg := store.Config{Schema: schema, Table: table}
		migs, err := migrate.Migrations(cfg)
		if err != nil {
			t.Fatal(err)
		}
		q := pgx.Identifier{schema, table}.Sanitize()
		if _, err := pool.Exec(ctx, "CREATE TABLE "+q+" (id bigint, dispatched_at timestamptz, parked_at timestamptz);"+
			"CREATE INDEX ON "+q+" (dispatched_at) WHERE dispatched_at IS NOT NULL; CREATE INDEX ON "+q+" (id) WHERE parked_at IS NOT NULL"); err != nil {
			t.Fatal(err)
		}
		var chosen []string
		rows, err := pool.Query(ctx, "SELECT indexname::text FROM pg_indexes WHERE schemaname = $1 AND tablename = $2 ORDER BY indexname", schema, table)
		if err != nil {
			t.Fatal(err)
		}
		if chosen, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
			t.Fatal(err)
		}
		var ours []string
		for _, m := range migs[1:3] {
			q := named.FindStringSubmatch(m.Steps[0].Statements[0].SQL)[1]
			ours = append(ours, strings.ReplaceAll(q[1:len(q)-1], `""`, `"`))
		}
		sort.Strings(ours)
		if strings.Join(ours, " ") != strings.Join(chosen, " ") {
			t.Errorf("table %q: migrations 2 and 3 name %v, PostgreSQL chose %v", table, ours, chosen)
		}
	}
}
