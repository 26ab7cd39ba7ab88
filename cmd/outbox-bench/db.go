package main

import (
	"bufio"
	"context"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/migrate"
)

type bench struct {
	cfg  config
	log  *slog.Logger
	pool *pgxpool.Pool // for setup and checks; each measured component gets its own
	seq  int
}

func newBench(ctx context.Context, c config, log *slog.Logger) (*bench, error) {
	pool, err := openPool(ctx, c.DatabaseURL, 8, nil)
	if err != nil {
		return nil, err
	}
	return &bench{cfg: c, log: log, pool: pool}, nil
}

func (b *bench) close() { b.pool.Close() }

// openPool connects a pool of at most maxConns; tracer may be nil.
func openPool(ctx context.Context, url string, maxConns int32, tracer pgx.QueryTracer) (*pgxpool.Pool, error) {
	pc, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("parse database URL: %w", err)
	}
	pc.MaxConns = maxConns
	pc.ConnConfig.Tracer = tracer
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("connect: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("ping database: %w", err)
	}
	return pool, nil
}

// schema creates a fresh, migrated outbox schema; drop removes it.
func (b *bench) schema(ctx context.Context, name string) (cfg store.Config, drop func(), err error) {
	b.seq++
	cfg = store.Config{Schema: fmt.Sprintf("bench_%s_%d", name, b.seq)}
	cfg.NotifyChannel = cfg.Schema // one channel per schema: runs do not wake each other
	q := ident(cfg.Schema)
	if _, err := b.pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+q+" CASCADE"); err != nil {
		return cfg, nil, fmt.Errorf("drop old schema: %w", err)
	}
	if _, err := migrate.Migrate(ctx, b.pool, cfg); err != nil {
		return cfg, nil, fmt.Errorf("migrate %s: %w", cfg.Schema, err)
	}
	drop = func() {
		if _, err := b.pool.Exec(context.WithoutCancel(ctx), "DROP SCHEMA "+q+" CASCADE"); err != nil {
			b.log.Warn("drop schema", "schema", cfg.Schema, "error", err)
		}
	}
	return cfg, drop, nil
}

func ident(parts ...string) string { return pgx.Identifier(parts).Sanitize() }

func outboxTable(cfg store.Config) string {
	cfg, _ = cfg.WithDefaults()
	return ident(cfg.Schema, cfg.Table)
}

// fill inserts n pending events into the outbox, in chunks so no single
// transaction grows huge, spread over the configured aggregates.
func (b *bench) fill(ctx context.Context, cfg store.Config, n int) error {
	return b.fillSized(ctx, cfg, n, b.cfg.PayloadBytes)
}

// fillSized is fill with payloads of about size bytes.
func (b *bench) fillSized(ctx context.Context, cfg store.Config, n, size int) error {
	start := time.Now()
	pad := strings.Repeat("x", max(0, size-40))
	// event_id takes the table's default, a time-ordered UUID as producers
	// write: random ones would scatter the unique index's inserts.
	q := `INSERT INTO ` + outboxTable(cfg) + ` (aggregate_id, type, payload)
SELECT ('00000000-0000-4000-8000-' || lpad(to_hex(g % $3), 12, '0'))::uuid,
       'bench.event',
       json_build_object('n', g, 'pad', $4::text)
FROM generate_series($1::bigint, $2::bigint) AS g`
	chunk := max(1, min(250_000, (256<<20)/max(size, 1))) // a statement of at most about 256 MB
	for from := 1; from <= n; from += chunk {
		to := min(n, from+chunk-1)
		if _, err := b.pool.Exec(ctx, q, from, to, b.cfg.Aggregates, pad); err != nil {
			return fmt.Errorf("fill backlog: %w", err)
		}
	}
	if _, err := b.pool.Exec(ctx, "VACUUM ANALYZE "+outboxTable(cfg)); err != nil {
		return fmt.Errorf("analyze backlog: %w", err)
	}
	b.log.Info("backlog ready", "schema", cfg.Schema, "events", n, "took", time.Since(start).Round(time.Millisecond))
	return nil
}

// fillLogOnly writes n log-only events of about the configured payload
// size as producers do, with the Go log writer, 1000 per transaction; the
// slot must exist.
func (b *bench) fillLogOnly(ctx context.Context, cfg store.Config, n int) error {
	start := time.Now()
	w, err := outbox.NewLogWriter(outbox.WriterOptions{Store: cfg})
	if err != nil {
		return err
	}
	pad := strings.Repeat("x", max(0, b.cfg.PayloadBytes-40))
	const perTx = 1000
	for from := 0; from < n; from += perTx {
		msgs := make([]outbox.Message, 0, perTx)
		for g := from; g < min(n, from+perTx); g++ {
			msgs = append(msgs, outbox.Message{
				AggregateID: fmt.Sprintf("00000000-0000-4000-8000-%012x", g%b.cfg.Aggregates), Type: "bench.event",
				Payload: fmt.Appendf(nil, `{"n":%d,"pad":%q}`, g, pad),
			})
		}
		err := pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error { return w.Write(ctx, tx, msgs...) })
		if err != nil {
			return fmt.Errorf("fill log-only backlog: %w", err)
		}
	}
	b.log.Info("log-only backlog ready", "schema", cfg.Schema, "events", n, "took", time.Since(start).Round(time.Millisecond))
	return nil
}

// settle gives the server a quiet start between measurements.
func (b *bench) settle(ctx context.Context) {
	if _, err := b.pool.Exec(ctx, "CHECKPOINT"); err != nil {
		b.log.Debug("checkpoint", "error", err)
	}
}

// env describes where the figures were taken.
type env struct {
	When       time.Time
	OS, Arch   string
	CPU        string
	CPUs       int
	MemoryGiB  float64
	LoadAvg    string // at the start: other work on the machine shows here
	GoVersion  string
	PostgreSQL string
	Settings   [][2]string
}

func (b *bench) environment(ctx context.Context) (env, error) {
	e := env{
		When: time.Now().UTC(), OS: runtime.GOOS, Arch: runtime.GOARCH,
		CPUs: runtime.NumCPU(), GoVersion: runtime.Version(),
		CPU: procField("/proc/cpuinfo", "model name"),
	}
	if kb := procField("/proc/meminfo", "MemTotal"); kb != "" {
		var v float64
		fmt.Sscanf(kb, "%f", &v)
		e.MemoryGiB = v / (1 << 20)
	}
	if raw, err := os.ReadFile("/proc/loadavg"); err == nil {
		f := strings.Fields(string(raw))
		if len(f) >= 3 {
			e.LoadAvg = strings.Join(f[:3], " ")
		}
	}
	if err := b.pool.QueryRow(ctx, "SHOW server_version").Scan(&e.PostgreSQL); err != nil {
		return e, fmt.Errorf("read server version: %w", err)
	}
	names := []string{"shared_buffers", "work_mem", "max_connections", "fsync", "synchronous_commit",
		"full_page_writes", "wal_level", "max_wal_size", "checkpoint_timeout", "autovacuum"}
	rows, err := b.pool.Query(ctx, "SELECT name, current_setting(name) FROM pg_settings WHERE name = ANY($1) ORDER BY name", names)
	if err != nil {
		return e, fmt.Errorf("read settings: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var k, v string
		if err := rows.Scan(&k, &v); err != nil {
			return e, fmt.Errorf("read settings: %w", err)
		}
		e.Settings = append(e.Settings, [2]string{k, v})
	}
	return e, rows.Err()
}

func procField(path, key string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if ok && strings.TrimSpace(k) == key {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// sqlRecorder is a pgx tracer that keeps the statements a component sends
// with their arguments, so the bench can EXPLAIN exactly what the store
// runs.
type sqlRecorder struct {
	mu   sync.Mutex
	seen []recorded
}

type recorded struct {
	sql  string
	args []any
}

func (r *sqlRecorder) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	r.mu.Lock()
	r.seen = append(r.seen, recorded{d.SQL, d.Args})
	r.mu.Unlock()
	return ctx
}

func (r *sqlRecorder) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// The store sends its claim in a batch (pgx.BatchTracer).
func (r *sqlRecorder) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (r *sqlRecorder) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	r.mu.Lock()
	r.seen = append(r.seen, recorded{d.SQL, d.Args})
	r.mu.Unlock()
}

func (r *sqlRecorder) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// find returns the first recorded statement containing substr, and the
// arguments it was sent with.
func (r *sqlRecorder) find(substr string) (string, []any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range r.seen {
		if strings.Contains(s.sql, substr) {
			return s.sql, s.args
		}
	}
	return "", nil
}
