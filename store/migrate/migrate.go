package migrate

import (
	"bytes"
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"text/template"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/outboxhq/outbox/store"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migration is one versioned schema change, applied as a sequence of
// steps so that no step holds a lock that stops producers for long.
type Migration struct {
	Version int
	Name    string
	SQL     string // the whole file, with the configured names filled in
	Steps   []Step
}

// StepKind says how the runner applies a step.
type StepKind int

const (
	// StepTx runs the step's statements in one transaction. When one of
	// them takes a lock that blocks INSERT, the transaction runs under
	// lock_timeout and is retried after a pause when the lock is busy.
	StepTx StepKind = iota
	// StepConcurrent runs one statement outside a transaction, such as
	// CREATE INDEX CONCURRENTLY.
	StepConcurrent
	// StepBatch runs one UPDATE over ranges of seq, [$1, $2), each range
	// in a transaction of its own.
	StepBatch
)

func (k StepKind) String() string {
	switch k {
	case StepConcurrent:
		return "outside a transaction"
	case StepBatch:
		return "in batches over seq, a transaction each"
	default:
		return "in a transaction"
	}
}

// Step is the unit the runner applies and records: after a crash, the
// migration resumes at the first step not recorded.
type Step struct {
	Kind       StepKind
	Statements []Statement
}

// BlocksWrites reports whether a statement of the step takes a lock that
// makes producers' INSERTs wait.
func (s Step) BlocksWrites() bool {
	for _, st := range s.Statements {
		if st.Lock.BlocksWrites {
			return true
		}
	}
	return false
}

// SQL is the step's statements as one script.
func (s Step) SQL() string {
	var b strings.Builder
	for i, st := range s.Statements {
		if i > 0 {
			b.WriteString(";\n")
		}
		b.WriteString(st.SQL)
	}
	return b.String()
}

// Statement is one SQL statement of a step with the lock it takes on the
// outbox table.
type Statement struct {
	SQL  string
	Lock Lock
}

// Lock is the strongest table lock a statement takes on the outbox.
type Lock struct {
	Mode         string // PostgreSQL's name: "ACCESS EXCLUSIVE", ...; "" for none
	BlocksWrites bool   // INSERT waits while it is held
	Note         string // how long it is held, in words
}

func (l Lock) String() string {
	if l.Mode == "" {
		return "no lock on the outbox table (" + l.Note + ")"
	}
	s := l.Mode
	if l.BlocksWrites {
		s += ", blocks producers"
	} else {
		s += ", producers go on"
	}
	return s + " (" + l.Note + ")"
}

// lockRules classify a statement by its leading words, most specific
// first. A statement no rule matches fails Migrations, so a new kind of
// statement gets a rule and a reviewed lock before it ships.
var lockRules = []struct {
	prefix *regexp.Regexp
	lock   Lock
}{
	{regexp.MustCompile(`^CREATE (UNIQUE )?INDEX CONCURRENTLY `), Lock{"SHARE UPDATE EXCLUSIVE", false, "while the index is built"}},
	{regexp.MustCompile(`^DROP INDEX CONCURRENTLY `), Lock{"SHARE UPDATE EXCLUSIVE", false, "brief"}},
	// Only the outbox table is created without IF NOT EXISTS (migration
	// 1); the tables beside it are created with it.
	{regexp.MustCompile(`^CREATE TABLE IF NOT EXISTS `), Lock{"", false, "a table beside it"}},
	{regexp.MustCompile(`^(CREATE TABLE|CREATE (UNIQUE )?INDEX)`), Lock{"ACCESS EXCLUSIVE", true, "on a table created in the same transaction"}},
	{regexp.MustCompile(`^ALTER TABLE \S+ VALIDATE CONSTRAINT `), Lock{"SHARE UPDATE EXCLUSIVE", false, "while the rows are checked"}},
	{regexp.MustCompile(`^ALTER TABLE `), Lock{"ACCESS EXCLUSIVE", true, "catalog change only, under lock_timeout"}},
	{regexp.MustCompile(`^DROP TRIGGER `), Lock{"ACCESS EXCLUSIVE", true, "catalog change only, under lock_timeout"}},
	{regexp.MustCompile(`^CREATE TRIGGER `), Lock{"SHARE ROW EXCLUSIVE", true, "catalog change only, under lock_timeout"}},
	{regexp.MustCompile(`^ALTER INDEX `), Lock{"SHARE UPDATE EXCLUSIVE", false, "on the index, brief"}},
	{regexp.MustCompile(`^(WITH .* )?UPDATE `), Lock{"ROW EXCLUSIVE", false, "row locks on the rows it changes"}},
	{regexp.MustCompile(`^VACUUM `), Lock{"SHARE UPDATE EXCLUSIVE", false, "while the table is vacuumed"}},
	{regexp.MustCompile(`^CREATE (OR REPLACE )?VIEW `), Lock{"ACCESS SHARE", false, "brief"}},
	{regexp.MustCompile(`^(CREATE( OR REPLACE)?|DROP) FUNCTION `), Lock{"", false, "a function"}},
}

func lockOf(stmt string) (Lock, bool) {
	flat := flatten(stmt)
	for _, r := range lockRules {
		if r.prefix.MatchString(flat) {
			return r.lock, true
		}
	}
	return Lock{}, false
}

// Migrations returns every migration for cfg, in version order.
func Migrations(cfg store.Config) ([]Migration, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return nil, err
	}
	entries, err := fs.ReadDir(migrationFiles, "migrations")
	if err != nil {
		return nil, fmt.Errorf("read migrations: %w", err)
	}
	n := cfg.Names()
	var out []Migration
	for _, e := range entries {
		base := strings.TrimSuffix(e.Name(), ".sql")
		num, name, ok := strings.Cut(base, "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil {
			return nil, fmt.Errorf("migration file %s: name must be NNNN_name.sql", e.Name())
		}
		raw, err := migrationFiles.ReadFile("migrations/" + e.Name())
		if err != nil {
			return nil, fmt.Errorf("read migration %s: %w", e.Name(), err)
		}
		// Steps are split before the names are filled in, so no name can
		// look like a step marker.
		steps, sql, err := parseSteps(e.Name(), string(raw), n)
		if err != nil {
			return nil, fmt.Errorf("migration %s: %w", e.Name(), err)
		}
		out = append(out, Migration{Version: v, Name: name, SQL: sql, Steps: steps})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out, nil
}

// stepMarker starts a step in a migration file: "--- step", optionally
// followed by "concurrently" or "batch".
var stepMarker = regexp.MustCompile(`(?m)^--- step\b(.*)$`)

func parseSteps(file, raw string, n store.Names) ([]Step, string, error) {
	marks := stepMarker.FindAllStringSubmatchIndex(raw, -1)
	if len(marks) == 0 || strings.TrimSpace(flatten(raw[:marks[0][0]])) != "" {
		return nil, "", errors.New(`statements before the first "--- step" line`)
	}
	var steps []Step
	var whole strings.Builder
	whole.WriteString(raw[:marks[0][0]])
	for i, m := range marks {
		end := len(raw)
		if i+1 < len(marks) {
			end = marks[i+1][0]
		}
		tmpl, err := template.New(file).Option("missingkey=error").Parse(raw[m[1]:end])
		if err != nil {
			return nil, "", fmt.Errorf("parse step %d: %w", i+1, err)
		}
		var sql bytes.Buffer
		if err := tmpl.Execute(&sql, n); err != nil {
			return nil, "", fmt.Errorf("render step %d: %w", i+1, err)
		}
		whole.WriteString(raw[m[0]:m[1]])
		whole.WriteString(sql.String())
		var s Step
		switch kind := strings.TrimSpace(raw[m[2]:m[3]]); kind {
		case "":
			s.Kind = StepTx
		case "concurrently":
			s.Kind = StepConcurrent
		case "batch":
			s.Kind = StepBatch
		default:
			return nil, "", fmt.Errorf("step %d: unknown kind %q (want none, concurrently or batch)", i+1, kind)
		}
		for _, stmt := range splitStatements(sql.String()) {
			lock, ok := lockOf(stmt)
			if !ok {
				return nil, "", fmt.Errorf("step %d: no lock rule for statement %.60q", i+1, stmt)
			}
			s.Statements = append(s.Statements, Statement{SQL: stmt, Lock: lock})
		}
		if len(s.Statements) == 0 {
			return nil, "", fmt.Errorf("step %d has no statement", i+1)
		}
		if s.Kind != StepTx && len(s.Statements) != 1 {
			return nil, "", fmt.Errorf("step %d (%s) has %d statements, want one", i+1, s.Kind, len(s.Statements))
		}
		if s.Kind == StepBatch && (!strings.Contains(s.Statements[0].SQL, "$1") || !strings.Contains(s.Statements[0].SQL, "$2")) {
			return nil, "", fmt.Errorf("step %d: a batch statement bounds seq by $1 and $2", i+1)
		}
		steps = append(steps, s)
	}
	return steps, whole.String(), nil
}

// splitStatements splits a script at the semicolons outside quotes,
// dollar quotes and comments, dropping empty statements. Comments stay
// with the statement they precede.
func splitStatements(sql string) []string {
	var out []string
	start := 0
	flush := func(end int) {
		if s := strings.TrimSpace(sql[start:end]); flatten(s) != "" {
			out = append(out, s)
		}
	}
	for i := 0; i < len(sql); i++ {
		switch c := sql[i]; {
		case c == '-' && strings.HasPrefix(sql[i:], "--"):
			if j := strings.IndexByte(sql[i:], '\n'); j >= 0 {
				i += j
			} else {
				i = len(sql)
			}
		case c == '/' && strings.HasPrefix(sql[i:], "/*"):
			if j := strings.Index(sql[i+2:], "*/"); j >= 0 {
				i += j + 3
			} else {
				i = len(sql)
			}
		case c == '\'' || c == '"':
			for i++; i < len(sql) && sql[i] != c; i++ {
			}
		case c == '$':
			if tag := dollarTag.FindString(sql[i:]); tag != "" {
				if j := strings.Index(sql[i+len(tag):], tag); j >= 0 {
					i += len(tag) + j + len(tag) - 1
				} else {
					i = len(sql)
				}
			}
		case c == ';':
			flush(i)
			start = i + 1
		}
	}
	if start < len(sql) {
		flush(len(sql))
	}
	return out
}

var dollarTag = regexp.MustCompile(`^\$([A-Za-z_][A-Za-z0-9_]*)?\$`)

// flatten is a statement reduced to what classifies it: comments dropped,
// each quoted name replaced by "X", each string emptied, each
// dollar-quoted body replaced by $$, and white space collapsed, so no name
// or body can look like a keyword.
func flatten(stmt string) string {
	var b strings.Builder
	for i := 0; i < len(stmt); i++ {
		switch c := stmt[i]; {
		case c == '-' && strings.HasPrefix(stmt[i:], "--"):
			j := strings.IndexByte(stmt[i:], '\n')
			if j < 0 {
				j = len(stmt) - i
			}
			i += j
			b.WriteByte(' ')
		case c == '/' && strings.HasPrefix(stmt[i:], "/*"):
			j := strings.Index(stmt[i+2:], "*/")
			if j < 0 {
				j = len(stmt) - i - 2
			}
			i += j + 3
			b.WriteByte(' ')
		case c == '\'' || c == '"':
			for i++; i < len(stmt) && stmt[i] != c; i++ {
			}
			if c == '"' {
				b.WriteString(`"X"`)
			} else {
				b.WriteString("''")
			}
		case c == '$' && dollarTag.MatchString(stmt[i:]):
			tag := dollarTag.FindString(stmt[i:])
			j := strings.Index(stmt[i+len(tag):], tag)
			if j < 0 {
				j = len(stmt) - i - len(tag)
			}
			i += len(tag) + j + len(tag) - 1
			b.WriteString("$$")
		default:
			b.WriteByte(c)
		}
	}
	return strings.Join(strings.Fields(b.String()), " ")
}

// The defaults of Options.
const (
	DefaultLockTimeout = 500 * time.Millisecond
	DefaultLockRetries = 100
	DefaultBatchRows   = 10000
)

// Options tune how Migrate applies the migrations. The zero value
// is the default.
type Options struct {
	// To stops after this version; 0 applies every migration.
	To int
	// LockTimeout bounds how long a statement waits for a lock that blocks
	// producers; while it waits, producers' INSERTs queue behind it.
	// Default 500ms, from 10ms to 10s.
	LockTimeout time.Duration
	// LockRetries is how many times a step that timed out on its lock is
	// tried again, after pauses from 100ms doubling to 10s. Default 100,
	// about a quarter of an hour; at least 1.
	LockRetries int
	// BatchRows is the width of the seq ranges a batch step updates in one
	// transaction. Default 10000, from 100 to 1,000,000.
	BatchRows int
	// Log receives the progress, each retry and its cause; nil discards.
	Log *slog.Logger
}

func (o Options) withDefaults() (Options, error) {
	if o.LockTimeout == 0 {
		o.LockTimeout = DefaultLockTimeout
	}
	if o.LockRetries == 0 {
		o.LockRetries = DefaultLockRetries
	}
	if o.BatchRows == 0 {
		o.BatchRows = DefaultBatchRows
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	switch {
	case o.To < 0:
		return o, fmt.Errorf("migrate options: to is %d, want 0 (latest) or a version", o.To)
	case o.LockTimeout < 10*time.Millisecond || o.LockTimeout > 10*time.Second:
		return o, fmt.Errorf("migrate options: lock timeout %v is outside 10ms to 10s", o.LockTimeout)
	case o.LockRetries < 1:
		return o, fmt.Errorf("migrate options: lock retries %d, want at least 1", o.LockRetries)
	case o.BatchRows < 100 || o.BatchRows > 1_000_000:
		return o, fmt.Errorf("migrate options: batch rows %d is outside 100 to 1000000", o.BatchRows)
	}
	return o, nil
}

// Migrate applies the migrations not yet applied, with the default
// options. It returns the versions it completed.
func Migrate(ctx context.Context, pool *pgxpool.Pool, cfg store.Config) ([]int, error) {
	return MigrateWith(ctx, pool, cfg, Options{})
}

// MigrateWith applies the migrations not yet applied, step by step, each
// step recorded in the version row as it completes, so a run stopped
// midway resumes where it stopped. A session advisory lock serializes
// concurrent callers. No step holds a lock that blocks producers for more
// than opts.LockTimeout plus a catalog change. It returns the versions it
// completed.
func MigrateWith(ctx context.Context, pool *pgxpool.Pool, cfg store.Config, opts Options) ([]int, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return nil, err
	}
	opts, err = opts.withDefaults()
	if err != nil {
		return nil, err
	}
	migs, err := Migrations(cfg)
	if err != nil {
		return nil, err
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("migrate %s.%s: acquire connection: %w", cfg.Schema, cfg.Table, err)
	}
	defer conn.Release()
	r := &runner{conn: conn.Conn(), cfg: cfg, n: cfg.Names(), opts: opts, log: opts.Log.With("schema", cfg.Schema, "table", cfg.Table)}
	if err := r.lock(ctx); err != nil {
		return nil, fmt.Errorf("migrate %s.%s: %w", cfg.Schema, cfg.Table, err)
	}
	defer r.unlock()
	applied, err := r.run(ctx, migs)
	if err != nil {
		return applied, fmt.Errorf("migrate %s.%s: %w", cfg.Schema, cfg.Table, err)
	}
	return applied, nil
}

type runner struct {
	conn *pgx.Conn
	cfg  store.Config
	n    store.Names
	opts Options
	log  *slog.Logger
}

func (r *runner) lockKey() string { return "outbox migrate " + r.cfg.Schema + "." + r.cfg.Table }

// lock takes the session advisory lock, polling: a session blocked in
// pg_advisory_lock holds a snapshot, and CREATE INDEX CONCURRENTLY in the
// session that has the lock would wait for that snapshot forever.
func (r *runner) lock(ctx context.Context) error {
	logged := false
	for {
		var ok bool
		if err := r.conn.QueryRow(ctx, "SELECT pg_try_advisory_lock(hashtextextended($1, 0))", r.lockKey()).Scan(&ok); err != nil {
			return fmt.Errorf("take migration lock: %w", err)
		}
		if ok {
			return nil
		}
		if !logged {
			r.log.Info("waiting for another migrator to finish")
			logged = true
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("take migration lock: %w", ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// unlock releases the advisory lock; when it cannot, it closes the
// connection, which releases it too.
func (r *runner) unlock() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := r.conn.Exec(ctx, "SELECT pg_advisory_unlock(hashtextextended($1, 0))", r.lockKey()); err != nil {
		_ = r.conn.Close(ctx)
	}
}

// progress is what the migrations table records: the complete versions
// and, for one begun but not finished, the number of its steps done.
type progress struct {
	done    map[int]bool
	partial map[int]int
}

func (r *runner) setup(ctx context.Context) (progress, error) {
	var haveSchema bool
	if err := r.conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", r.cfg.Schema).Scan(&haveSchema); err != nil {
		return progress{}, fmt.Errorf("look up schema: %w", err)
	}
	// CREATE SCHEMA IF NOT EXISTS needs CREATE on the database even when
	// the schema exists, so a role given only a schema can still migrate.
	if !haveSchema {
		if _, err := r.conn.Exec(ctx, createSchemaSQL(r.n)); err != nil {
			return progress{}, fmt.Errorf("create schema: %w", err)
		}
	}
	for _, q := range migrationsTableSQL(r.n) {
		if _, err := r.conn.Exec(ctx, q); err != nil {
			return progress{}, fmt.Errorf("create migrations table: %w", err)
		}
	}
	p := progress{done: map[int]bool{}, partial: map[int]int{}}
	rows, err := r.conn.Query(ctx, "SELECT version, step FROM "+r.n.Migrations)
	if err != nil {
		return p, fmt.Errorf("read schema version: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var v int
		var step *int
		if err := rows.Scan(&v, &step); err != nil {
			return p, fmt.Errorf("read schema version: %w", err)
		}
		if step == nil {
			p.done[v] = true
		} else {
			p.partial[v] = *step
		}
	}
	if err := rows.Err(); err != nil {
		return p, fmt.Errorf("read schema version: %w", err)
	}
	return p, nil
}

func (r *runner) run(ctx context.Context, migs []Migration) ([]int, error) {
	p, err := r.setup(ctx)
	if err != nil {
		return nil, err
	}
	var applied []int
	for _, m := range migs {
		if p.done[m.Version] || (r.opts.To > 0 && m.Version > r.opts.To) {
			continue
		}
		from := p.partial[m.Version]
		if from > 0 {
			r.log.Info("resuming migration", "version", m.Version, "name", m.Name, "steps_done", from, "steps", len(m.Steps))
		}
		for i := from; i < len(m.Steps); i++ {
			start := time.Now()
			if err := r.step(ctx, m, i); err != nil {
				return applied, fmt.Errorf("apply migration %04d_%s step %d of %d: %w", m.Version, m.Name, i+1, len(m.Steps), err)
			}
			r.log.Info("migration step applied", "version", m.Version, "name", m.Name, "step", i+1, "steps", len(m.Steps),
				"kind", m.Steps[i].Kind.String(), "took", time.Since(start).Round(time.Millisecond))
		}
		applied = append(applied, m.Version)
	}
	return applied, nil
}

// record is the statement that marks step i of m done.
func (r *runner) record(m Migration, i int) string { return stepRecordSQL(r.n, m, i) }

// stepRecordSQL records step i of m done: the version row with the number
// of steps done, or with step NULL once the last is.
func stepRecordSQL(n store.Names, m Migration, i int) string {
	step := "NULL"
	if i+1 < len(m.Steps) {
		step = strconv.Itoa(i + 1)
	}
	return fmt.Sprintf("INSERT INTO %s (version, name, step) VALUES (%d, %s, %s) ON CONFLICT (version) DO UPDATE SET step = EXCLUDED.step, applied_at = now()",
		n.Migrations, m.Version, quoteLiteral(m.Name), step)
}

func (r *runner) step(ctx context.Context, m Migration, i int) error {
	s := m.Steps[i]
	switch s.Kind {
	case StepConcurrent:
		if err := r.dropInvalidIndex(ctx, s.Statements[0].SQL); err != nil {
			return err
		}
		if _, err := r.conn.Exec(ctx, s.Statements[0].SQL); err != nil {
			return err
		}
		_, err := r.conn.Exec(ctx, r.record(m, i))
		return err
	case StepBatch:
		if err := r.batches(ctx, m, s.Statements[0].SQL); err != nil {
			return err
		}
		_, err := r.conn.Exec(ctx, r.record(m, i))
		return err
	}
	pause := 100 * time.Millisecond
	for attempt := 1; ; attempt++ {
		err := pgx.BeginFunc(ctx, r.conn, func(tx pgx.Tx) error {
			if s.BlocksWrites() {
				if _, err := tx.Exec(ctx, "SELECT set_config('lock_timeout', $1, true)", strconv.FormatInt(r.opts.LockTimeout.Milliseconds(), 10)+"ms"); err != nil {
					return fmt.Errorf("set lock_timeout: %w", err)
				}
			}
			if _, err := tx.Exec(ctx, s.SQL()); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, r.record(m, i))
			return err
		})
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "55P03" { // lock_not_available
			return err
		}
		if attempt > r.opts.LockRetries {
			return fmt.Errorf("lock still busy after %d tries of %v each (find the session holding it in pg_locks): %w", attempt, r.opts.LockTimeout, err)
		}
		r.log.Warn("migration step waited too long for a lock; producers went on, trying again",
			"version", m.Version, "step", i+1, "attempt", attempt, "lock_timeout", r.opts.LockTimeout, "pause", pause)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(pause):
		}
		pause = min(2*pause, 10*time.Second)
	}
}

var concurrentIndex = regexp.MustCompile(`CREATE (?:UNIQUE )?INDEX CONCURRENTLY IF NOT EXISTS ("(?:[^"]|"")+")`)

// dropInvalidIndex drops what a CREATE INDEX CONCURRENTLY that failed or
// was stopped left behind: an invalid index of the same name, which IF NOT
// EXISTS would otherwise keep.
func (r *runner) dropInvalidIndex(ctx context.Context, stmt string) error {
	m := concurrentIndex.FindStringSubmatch(stmt)
	if m == nil {
		return nil
	}
	name := r.n.Schema + "." + m[1]
	var invalid bool
	err := r.conn.QueryRow(ctx, "SELECT NOT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)", name).Scan(&invalid)
	if errors.Is(err, pgx.ErrNoRows) || (err == nil && !invalid) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("look up index %s: %w", name, err)
	}
	r.log.Warn("dropping an invalid index left by an earlier run", "index", name)
	if _, err := r.conn.Exec(ctx, "DROP INDEX CONCURRENTLY IF EXISTS "+name); err != nil {
		return fmt.Errorf("drop invalid index %s: %w", name, err)
	}
	return nil
}

// batches runs stmt over the seq ranges of the rows there are now; rows
// inserted later are the trigger's to fill.
func (r *runner) batches(ctx context.Context, m Migration, stmt string) error {
	var lo, hi *int64
	if err := r.conn.QueryRow(ctx, "SELECT min(seq), max(seq) FROM "+r.n.Outbox).Scan(&lo, &hi); err != nil {
		return fmt.Errorf("read seq range: %w", err)
	}
	if lo == nil {
		return nil
	}
	width := int64(r.opts.BatchRows)
	last := time.Now()
	var rows int64
	for from := *lo; from <= *hi; from += width {
		tag, err := r.conn.Exec(ctx, stmt, from, from+width)
		if err != nil {
			return fmt.Errorf("batch from seq %d: %w", from, err)
		}
		rows += tag.RowsAffected()
		if time.Since(last) > 5*time.Second {
			r.log.Info("migration batch progress", "version", m.Version, "seq", from+width, "of", *hi, "rows", rows)
			last = time.Now()
		}
	}
	return nil
}

func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

func createSchemaSQL(n store.Names) string { return "CREATE SCHEMA IF NOT EXISTS " + n.Schema }

// migrationsTableSQL creates the table of applied versions and gives one
// made by an earlier release the step column. step NULL means complete;
// a number, how many steps of a migration begun are done.
func migrationsTableSQL(n store.Names) []string {
	return []string{
		"CREATE TABLE IF NOT EXISTS " + n.Migrations +
			" (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at TIMESTAMPTZ NOT NULL DEFAULT now(), step INTEGER)",
		"ALTER TABLE " + n.Migrations + " ADD COLUMN IF NOT EXISTS step INTEGER",
	}
}

// MigrationSetupSQL returns the statements Migrate runs before the
// migrations: the schema and the table that records the applied versions,
// both created only if missing. With MigrationRecordSQL it lets a DBA
// apply the migrations with a tool of their own and leave the schema as
// Migrate would.
func MigrationSetupSQL(cfg store.Config) ([]string, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return nil, err
	}
	n := cfg.Names()
	// As in Migrate, the schema is created only when missing: CREATE SCHEMA
	// IF NOT EXISTS needs CREATE on the database even when it exists.
	schema := "DO $outbox$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = " +
		quoteLiteral(cfg.Schema) + ") THEN " + createSchemaSQL(n) + "; END IF; END $outbox$"
	return append([]string{schema}, migrationsTableSQL(n)...), nil
}

// MigrationRecordSQL returns the statement that records m as applied,
// the one Migrate runs with its last step.
func MigrationRecordSQL(cfg store.Config, m Migration) (string, error) {
	return MigrationStepRecordSQL(cfg, m, len(m.Steps)-1)
}

// MigrationStepRecordSQL returns the statement that records step i (from
// 0) of m as done, the one Migrate runs with that step: a migration
// stopped midway resumes after the last step recorded.
func MigrationStepRecordSQL(cfg store.Config, m Migration, i int) (string, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return "", err
	}
	if i < 0 || i >= len(m.Steps) {
		return "", fmt.Errorf("record migration %04d: step %d of %d", m.Version, i+1, len(m.Steps))
	}
	return stepRecordSQL(cfg.Names(), m, i), nil
}

// BatchSQL returns a batch step's statement as a DO block that runs it
// over every seq range of the outbox, committing after each: run outside
// a transaction block, as psql does by default.
func BatchSQL(cfg store.Config, s Step, rows int) (string, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return "", err
	}
	if s.Kind != StepBatch {
		return "", fmt.Errorf("batch sql: step runs %s, not in batches", s.Kind)
	}
	w := strconv.Itoa(rows)
	stmt := strings.NewReplacer("$1", "lo", "$2", "lo + "+w).Replace(s.Statements[0].SQL)
	return "DO $outbox$\nDECLARE lo bigint; hi bigint;\nBEGIN\n" +
		"    SELECT min(seq), max(seq) INTO lo, hi FROM " + cfg.Names().Outbox + ";\n" +
		"    WHILE lo <= hi LOOP\n" + stmt + ";\n        COMMIT;\n        lo := lo + " + w + ";\n    END LOOP;\nEND $outbox$", nil
}

// SchemaVersion returns the highest migration version applied in full, 0
// when the migrations table does not exist yet.
func SchemaVersion(ctx context.Context, pool *pgxpool.Pool, cfg store.Config) (int, error) {
	v, _, _, err := SchemaProgress(ctx, pool, cfg)
	return v, err
}

// SchemaProgress returns the highest migration version applied in full
// and, when a later one was begun and not finished, its version and how
// many of its steps are done (0, 0 when none).
func SchemaProgress(ctx context.Context, pool *pgxpool.Pool, cfg store.Config) (have, partial, steps int, err error) {
	cfg, err = cfg.WithDefaults()
	if err != nil {
		return 0, 0, 0, err
	}
	// to_jsonb reads step whether or not the column exists: a table made
	// by an earlier release has none, and a relay must not need to alter it.
	err = pool.QueryRow(ctx, `SELECT COALESCE(max(version) FILTER (WHERE to_jsonb(m) ->> 'step' IS NULL), 0),
       COALESCE(max(version) FILTER (WHERE to_jsonb(m) ->> 'step' IS NOT NULL), 0),
       COALESCE(max((to_jsonb(m) ->> 'step')::int), 0)
FROM `+cfg.Names().Migrations+` AS m`).Scan(&have, &partial, &steps)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42P01" { // undefined_table
		return 0, 0, 0, nil
	}
	if err != nil {
		return 0, 0, 0, fmt.Errorf("read schema version of %s.%s: %w", cfg.Schema, cfg.Table, err)
	}
	return have, partial, steps, nil
}
