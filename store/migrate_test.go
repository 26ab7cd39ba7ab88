package store_test

import (
	"context"
	"net/url"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
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
	if _, err := store.Migrate(ctx, pool, store.Config{Schema: schema}); err != nil {
		t.Fatalf("migrate as the schema's owner without CREATE on the database: %v", err)
	}
}
