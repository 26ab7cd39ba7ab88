package migrate_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store/migrate"
	tablesrc "github.com/outboxhq/outbox/store/table"
)

// Migration 7 converts a table holding events: UUID keys become their
// canonical text, pending events are claimed as before, and the new
// columns start empty.
func TestMigration7ConvertsKeys(t *testing.T) {
	ctx := context.Background()
	pool, cfg := upgradeFrom(t, 6)
	table := pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize()
	agg := "0190A7F4-8C3E-7B2A-9D41-5E6F7A8B9C0D" // uuid input is case-blind; its text is lowercase
	for _, typ := range []string{"a.one", "a.two"} {
		if _, err := pool.Exec(ctx, `INSERT INTO `+table+` (aggregate_id, type, payload) VALUES ($1, $2, '{"x": 1}')`, agg, typ); err != nil {
			t.Fatal(err)
		}
	}
	applied, err := migrate.Migrate(ctx, pool, cfg)
	// Later migrations follow it.
	if err != nil || len(applied) == 0 || applied[0] != 7 {
		t.Fatalf("migrate: %v %v, want 7 and any later ones", applied, err)
	}
	st, err := tablesrc.New(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	c, err := st.Claim(ctx, core.ClaimOptions{Limit: 10})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release(ctx)
	evs := c.Events()
	if len(evs) != 2 || evs[0].AggregateID != strings.ToLower(agg) || string(evs[1].Payload) != `{"x": 1}` || evs[0].ContentType != "" || evs[0].Topic != "" {
		t.Fatalf("claimed %+v after migration 7", evs)
	}
	var typ, collation string
	if err := pool.QueryRow(ctx, `SELECT data_type, collation_name FROM information_schema.columns
WHERE table_schema = $1 AND table_name = $2 AND column_name = 'aggregate_id'`, cfg.Schema, cfg.Table).Scan(&typ, &collation); err != nil {
		t.Fatal(err)
	}
	if typ != "text" || collation != "C" {
		t.Fatalf("aggregate_id is %s collate %s, want text collate C", typ, collation)
	}
}
