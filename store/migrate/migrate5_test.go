package migrate_test

import (
	"context"
	"strings"
	"testing"

	"github.com/google/uuid"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store/migrate"
	tablesrc "github.com/outboxhq/outbox/store/table"
)

// Migration 5 renames uid to event_id and id to seq on a table that holds
// events: every row keeps its identity and position, pending rows are
// claimed under the new names, and the uid default and the unique index
// keep working on event_id.
func TestMigration5RenamesIdentityColumns(t *testing.T) {
	ctx := context.Background()
	pool, cfg := upgradeFrom(t, 4)
	table := ident(cfg)
	agg := uuid.NewString()
	given := uuid.NewString()
	var doneSeq, givenSeq int64
	var defaulted string
	if err := pool.QueryRow(ctx, `INSERT INTO `+table+` (aggregate_id, type, payload, dispatched_at)
VALUES ($1, 'a.done', '{}', now()) RETURNING id`, agg).Scan(&doneSeq); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(ctx, `INSERT INTO `+table+` (uid, aggregate_id, type, payload)
VALUES ($1, $2, 'a.given', '{}') RETURNING id`, given, agg).Scan(&givenSeq); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(ctx, `INSERT INTO `+table+` (aggregate_id, type, payload)
VALUES ($1, 'a.defaulted', '{}') RETURNING uid::text`, agg).Scan(&defaulted); err != nil {
		t.Fatal(err)
	}

	applied, err := migrate.Migrate(ctx, pool, cfg)
	if err != nil {
		t.Fatalf("migrate: %v", err)
	}
	// Later migrations follow it.
	if len(applied) == 0 || applied[0] != 5 {
		t.Fatalf("applied %v, want 5 and any later ones", applied)
	}

	st, err := tablesrc.New(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	c, err := st.Claim(ctx, core.ClaimOptions{Limit: 10})
	if err != nil {
		t.Fatalf("claim after migration 5: %v", err)
	}
	evs := c.Events()
	if len(evs) != 2 || evs[0].ID != given || evs[0].Seq != givenSeq || evs[1].ID != defaulted || evs[1].Seq <= givenSeq {
		t.Fatalf("claimed %+v, want the pending events %s (seq %d) and %s after it", evs, given, givenSeq, defaulted)
	}
	if err := c.Release(ctx); err != nil {
		t.Fatal(err)
	}

	var seq int64
	if err := pool.QueryRow(ctx, `INSERT INTO `+table+` (aggregate_id, type, payload) VALUES ($1, 'a.new', '{}') RETURNING seq`, agg).Scan(&seq); err != nil {
		t.Fatalf("insert with defaults after migration 5: %v", err)
	}
	if seq <= givenSeq || seq <= doneSeq {
		t.Fatalf("new seq %d, want after %d", seq, givenSeq)
	}
	_, err = pool.Exec(ctx, `INSERT INTO `+table+` (event_id, aggregate_id, type, payload) VALUES ($1, $2, 'a.dup', '{}')`, given, agg)
	if err == nil || !strings.Contains(err.Error(), "_uid") {
		t.Fatalf("second row with event id %s: err = %v, want the unique index to refuse it", given, err)
	}
	_, err = pool.Exec(ctx, `INSERT INTO `+table+` (uid, aggregate_id, type, payload) VALUES ($1, $2, 'a.old', '{}')`, uuid.NewString(), agg)
	if err == nil || !strings.Contains(err.Error(), `column "uid"`) {
		t.Fatalf("insert naming the old column: err = %v, want it refused", err)
	}
}
