package migrate_test

import (
	"context"
	"fmt"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/migrate"
)

// A role a DBA gave only a schema of its own (no CREATE on the database)
// can still migrate into it.
func TestMigrateIntoExistingSchemaWithoutDatabaseCreate(t *testing.T) {
	ctx := context.Background()
	admin := pgtest.NewPool(t)
	schema, role := "migrate_owned_schema", "outbox_migrate_only"
	for _, q := range []string{
		"DROP SCHEMA IF EXISTS " + schema + " CASCADE",
		"DROP ROLE IF EXISTS " + role,
		"CREATE ROLE " + role + " LOGIN",
		"CREATE SCHEMA " + schema + " AUTHORIZATION " + role,
	} {
		if _, err := admin.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	t.Cleanup(func() {
		_, _ = admin.Exec(ctx, "DROP SCHEMA IF EXISTS "+schema+" CASCADE")
		_, _ = admin.Exec(ctx, "DROP ROLE IF EXISTS "+role)
	})
	u, err := url.Parse(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(role)
	pool, err := pgxpool.New(ctx, u.String())
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if _, err := migrate.Migrate(ctx, pool, store.Config{Schema: schema}); err != nil {
		t.Fatalf("migrate as the schema's owner without CREATE on the database: %v", err)
	}
}

// ident is the quoted name of cfg's outbox table.
func ident(cfg store.Config) string {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		panic(err)
	}
	return pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize()
}

func quote(name string) string { return pgx.Identifier{name}.Sanitize() }

func TestMigrateIsIdempotentAndConcurrent(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.NewPool(t)
	cfg := store.Config{Schema: fmt.Sprintf("migrate_%d", time.Now().UnixNano())}
	t.Cleanup(func() {
		pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{cfg.Schema}.Sanitize()+" CASCADE")
	})
	errs := make(chan error, 4)
	applied := make(chan []int, 4)
	for range 4 {
		go func() {
			v, err := migrate.Migrate(ctx, pool, cfg)
			errs <- err
			applied <- v
		}()
	}
	total := 0
	for range 4 {
		if err := <-errs; err != nil {
			t.Fatalf("concurrent migrate: %v", err)
		}
		total += len(<-applied)
	}
	migs, err := migrate.Migrations(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if total != len(migs) {
		t.Fatalf("concurrent migrations applied %d versions in total, want each of %d once", total, len(migs))
	}
	v, err := migrate.Migrate(ctx, pool, cfg)
	if err != nil || len(v) != 0 {
		t.Fatalf("second migrate applied %v, %v; want nothing", v, err)
	}
}
