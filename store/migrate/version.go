package migrate

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/outboxhq/outbox/store"
)

// ErrNotMigrated is returned by CheckSchema when the schema is missing or
// older than this build expects.
var ErrNotMigrated = errors.New("schema is not migrated (run `outbox migrate`)")

// CheckSchema verifies that every migration of this build is applied, so a
// relay started against an empty database says so instead of failing on
// its first claim.
func CheckSchema(ctx context.Context, pool *pgxpool.Pool, cfg store.Config) error {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return err
	}
	migs, err := Migrations(cfg)
	if err != nil {
		return err
	}
	want := migs[len(migs)-1].Version
	have, partial, steps, err := SchemaProgress(ctx, pool, cfg)
	if err != nil {
		return fmt.Errorf("check schema %s.%s: %w", cfg.Schema, cfg.Table, err)
	}
	if partial > have && have < want {
		return fmt.Errorf("check schema %s.%s: at version %d with migration %d stopped after step %d, this build needs %d: %w",
			cfg.Schema, cfg.Table, have, partial, steps, want, ErrNotMigrated)
	}
	if have == 0 {
		return fmt.Errorf("check schema %s.%s: %w", cfg.Schema, cfg.Table, ErrNotMigrated)
	}
	if have < want {
		return fmt.Errorf("check schema %s.%s: at version %d, this build needs %d: %w", cfg.Schema, cfg.Table, have, want, ErrNotMigrated)
	}
	return nil
}
