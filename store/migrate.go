package store

import (
	"bytes"
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"sort"
	"strconv"
	"strings"
	"text/template"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migration is one versioned schema change.
type Migration struct {
	Version int
	Name    string
	SQL     string // with the configured names filled in
}

// Migrations returns every migration for cfg, in version order.
func Migrations(cfg Config) ([]Migration, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return nil, err
	}
	entries, err := fs.ReadDir(migrationFiles, "migrations")
	if err != nil {
		return nil, fmt.Errorf("read migrations: %w", err)
	}
	n := cfg.names()
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
		tmpl, err := template.New(e.Name()).Option("missingkey=error").Parse(string(raw))
		if err != nil {
			return nil, fmt.Errorf("parse migration %s: %w", e.Name(), err)
		}
		var sql bytes.Buffer
		if err := tmpl.Execute(&sql, n); err != nil {
			return nil, fmt.Errorf("render migration %s: %w", e.Name(), err)
		}
		out = append(out, Migration{Version: v, Name: name, SQL: sql.String()})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out, nil
}

// Migrate applies the migrations not yet applied, in one transaction under
// an advisory lock, so concurrent callers are safe. It returns the versions
// it applied.
func Migrate(ctx context.Context, pool *pgxpool.Pool, cfg Config) ([]int, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return nil, err
	}
	migs, err := Migrations(cfg)
	if err != nil {
		return nil, err
	}
	n := cfg.names()
	var applied []int
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		lockKey := "outbox migrate " + cfg.Schema + "." + cfg.Table
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", lockKey); err != nil {
			return fmt.Errorf("take migration lock: %w", err)
		}
		// CREATE SCHEMA IF NOT EXISTS needs CREATE on the database even when
		// the schema exists, so a role given only a schema can still migrate.
		var haveSchema bool
		if err := tx.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", cfg.Schema).Scan(&haveSchema); err != nil {
			return fmt.Errorf("look up schema: %w", err)
		}
		if !haveSchema {
			if _, err := tx.Exec(ctx, createSchemaSQL(n)); err != nil {
				return fmt.Errorf("create schema: %w", err)
			}
		}
		if _, err := tx.Exec(ctx, createMigrationsTableSQL(n)); err != nil {
			return fmt.Errorf("create migrations table: %w", err)
		}
		var current int
		if err := tx.QueryRow(ctx, "SELECT COALESCE(max(version), 0) FROM "+n.Migrations).Scan(&current); err != nil {
			return fmt.Errorf("read schema version: %w", err)
		}
		for _, m := range migs {
			if m.Version <= current {
				continue
			}
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return fmt.Errorf("apply migration %04d_%s: %w", m.Version, m.Name, err)
			}
			if _, err := tx.Exec(ctx, recordSQL(n, m)); err != nil {
				return fmt.Errorf("record migration %04d: %w", m.Version, err)
			}
			applied = append(applied, m.Version)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("migrate %s.%s: %w", cfg.Schema, cfg.Table, err)
	}
	return applied, nil
}

func createSchemaSQL(n names) string { return "CREATE SCHEMA IF NOT EXISTS " + n.Schema }

func createMigrationsTableSQL(n names) string {
	return "CREATE TABLE IF NOT EXISTS " + n.Migrations +
		" (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"
}

func recordSQL(n names, m Migration) string {
	return fmt.Sprintf("INSERT INTO %s (version, name) VALUES (%d, '%s')", n.Migrations, m.Version, strings.ReplaceAll(m.Name, "'", "''"))
}

// MigrationSetupSQL returns the statements Migrate runs before the
// migrations: the schema and the table that records the applied versions,
// both created only if missing. With MigrationRecordSQL it lets a DBA
// apply the migrations with a tool of their own and leave the schema as
// Migrate would.
func MigrationSetupSQL(cfg Config) ([]string, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return nil, err
	}
	n := cfg.names()
	// As in Migrate, the schema is created only when missing: CREATE SCHEMA
	// IF NOT EXISTS needs CREATE on the database even when it exists.
	schema := "DO $outbox$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = '" +
		strings.ReplaceAll(cfg.Schema, "'", "''") + "') THEN " + createSchemaSQL(n) + "; END IF; END $outbox$"
	return []string{schema, createMigrationsTableSQL(n)}, nil
}

// MigrationRecordSQL returns the statement that records m as applied, the
// one Migrate runs after m's SQL in the same transaction.
func MigrationRecordSQL(cfg Config, m Migration) (string, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return "", err
	}
	return recordSQL(cfg.names(), m), nil
}

// SchemaVersion returns the highest applied migration version, 0 when the
// migrations table does not exist yet.
func SchemaVersion(ctx context.Context, pool *pgxpool.Pool, cfg Config) (int, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return 0, err
	}
	var have int
	err = pool.QueryRow(ctx, "SELECT COALESCE(max(version), 0) FROM "+cfg.names().Migrations).Scan(&have)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42P01" { // undefined_table
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("read schema version of %s.%s: %w", cfg.Schema, cfg.Table, err)
	}
	return have, nil
}
