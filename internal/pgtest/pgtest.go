// Package pgtest gives tests a real PostgreSQL: a fresh, migrated schema per
// test on the server named by OUTBOX_TEST_DATABASE_URL (which `make test`
// starts), dropped when the test ends.
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/migrate"
)

// EnvURL names the variable holding the test server's URL.
const EnvURL = "OUTBOX_TEST_DATABASE_URL"

// URL returns the test server's URL. Without one the test is skipped, or
// fails under CI, where skipping would hide untested code.
func URL(t testing.TB) string {
	t.Helper()
	u := os.Getenv(EnvURL)
	if u == "" {
		if os.Getenv("CI") != "" {
			t.Fatalf("%s is not set; run the tests with `make test`", EnvURL)
		}
		t.Skipf("%s is not set; `make test` starts a server", EnvURL)
	}
	return u
}

// NewPool opens a pool on the test server, closed at cleanup.
func NewPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(URL(t))
	if err != nil {
		t.Fatalf("parse %s: %v", EnvURL, err)
	}
	cfg.MaxConns = 20
	// The pool keeps the context it is created with; bound only the ping.
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("connect to test database: %v", err)
	}
	t.Cleanup(pool.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := pool.Ping(ctx); err != nil {
		t.Fatalf("connect to test database: %v", err)
	}
	return pool
}

// Schema creates and migrates a schema of its own for this test and
// returns a pool and the store configuration naming it.
func Schema(t testing.TB) (*pgxpool.Pool, store.Config) {
	t.Helper()
	return SchemaWith(t, store.Config{})
}

// SchemaWith is Schema with the other fields of cfg (a notify channel, a
// table name) applied before migrating; the schema is always a fresh one.
func SchemaWith(t testing.TB, cfg store.Config) (*pgxpool.Pool, store.Config) {
	t.Helper()
	pool := NewPool(t)
	cfg.Schema = "test_" + randomHex(6)
	ctx := context.Background()
	if _, err := migrate.Migrate(ctx, pool, cfg); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	t.Cleanup(func() {
		if _, err := pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{cfg.Schema}.Sanitize()+" CASCADE"); err != nil {
			t.Logf("drop test schema %s: %v", cfg.Schema, err)
		}
	})
	return pool, cfg
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// EnvWALLevel names the variable scripts/services.sh sets to "logical"
// when it starts a server with wal_level=logical: the log relay's tests
// then fail, instead of skipping, on a server without it.
const EnvWALLevel = "OUTBOX_TEST_WAL_LEVEL"

// Logical skips the test unless the test server runs with
// wal_level=logical, which the log relay needs; under CI, or with
// OUTBOX_TEST_WAL_LEVEL=logical, such a server fails the test instead.
func Logical(t testing.TB) {
	t.Helper()
	pool := NewPool(t)
	var level string
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := pool.QueryRow(ctx, "SHOW wal_level").Scan(&level); err != nil {
		t.Fatalf("read wal_level: %v", err)
	}
	if level == "logical" {
		return
	}
	if os.Getenv(EnvWALLevel) == "logical" || os.Getenv("CI") != "" {
		t.Fatalf("the test server has wal_level=%s, but %s or CI asks for logical; run the tests with `make test`", level, EnvWALLevel)
	}
	t.Skipf("the test server has wal_level=%s; the log relay needs logical (`make test` starts such a server)", level)
}

// Process is a relay process's view of the test server: a pool of its
// own whose sessions carry a name, so that Kill can end them as a crash
// of the process would.
type Process struct {
	Pool *pgxpool.Pool
	Name string // application_name of its sessions; give it to replication connections too
}

// NewProcess opens a pool of conns connections named after the test and
// a random suffix, closed at cleanup.
func NewProcess(t testing.TB, conns int32) *Process {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(URL(t))
	if err != nil {
		t.Fatalf("parse %s: %v", EnvURL, err)
	}
	p := &Process{Name: "outbox-test-" + randomHex(6)}
	cfg.MaxConns = conns
	cfg.ConnConfig.RuntimeParams["application_name"] = p.Name
	if p.Pool, err = pgxpool.NewWithConfig(context.Background(), cfg); err != nil {
		t.Fatalf("connect to test database: %v", err)
	}
	t.Cleanup(p.Pool.Close)
	return p
}

// Kill ends every session of the process, through admin: open
// transactions roll back and replication connections drop, as when the
// process dies. The caller then stops the process without letting it
// record anything.
func (p *Process) Kill(t testing.TB, admin *pgxpool.Pool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := admin.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1", p.Name); err != nil {
		t.Fatalf("terminate %s: %v", p.Name, err)
	}
}
