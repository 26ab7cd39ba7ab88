package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"os"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/migrate"
)

// schema holds the run's outbox and the business tables around it.
const schema = "chaos"

// Role names on the run's own server.
const (
	relayRole    = "chaos_relay"
	producerRole = "chaos_producer"
	consumerRole = "chaos_consumer"
)

// database is the migrated schema and a URL for each role.
type database struct {
	admin                              *pgxpool.Pool
	cfg                                store.Config
	relayURL, producerURL, consumerURL string
	aggregates                         []string
}

// setupDatabase migrates the outbox as the superuser, creates the three
// least-privilege roles with passwords the server checks, and the business
// tables: aggregates (the producers' per-aggregate sequence) and effects
// (what the consumer does once per event).
func setupDatabase(ctx context.Context, adminURL string, aggregates int) (*database, error) {
	pc, err := pgxpool.ParseConfig(adminURL)
	if err != nil {
		return nil, fmt.Errorf("parse database URL: %w", err)
	}
	pc.MaxConns = 4
	admin, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("connect as superuser: %w", err)
	}
	db := &database{admin: admin, cfg: store.Config{Schema: schema}}
	if err := db.setup(ctx, adminURL, aggregates); err != nil {
		admin.Close()
		return nil, err
	}
	return db, nil
}

func (db *database) setup(ctx context.Context, adminURL string, aggregates int) error {
	cfg, err := db.cfg.WithDefaults()
	if err != nil {
		return err
	}
	db.cfg = cfg
	if _, err := migrate.Migrate(ctx, db.admin, db.cfg); err != nil {
		return err
	}
	u, err := url.Parse(adminURL)
	if err != nil {
		return fmt.Errorf("parse database URL: %w", err)
	}
	urls := map[string]*string{relayRole: &db.relayURL, producerRole: &db.producerURL, consumerRole: &db.consumerURL}
	for _, role := range []string{relayRole, producerRole, consumerRole} {
		password := randomHex(12)
		if _, err := db.admin.Exec(ctx, "CREATE ROLE "+role+" LOGIN PASSWORD '"+password+"'"); err != nil {
			return fmt.Errorf("create role %s: %w", role, err)
		}
		ru := *u
		ru.User = url.UserPassword(role, password)
		*urls[role] = ru.String()
	}
	if err := migrate.ApplyGrants(ctx, db.admin, db.cfg, migrate.Roles{Relay: relayRole, Producer: producerRole, Consumer: consumerRole}); err != nil {
		return err
	}
	business := `
CREATE TABLE chaos.aggregates (id UUID PRIMARY KEY, seq INTEGER NOT NULL DEFAULT 0);
CREATE TABLE chaos.effects (
    uid UUID PRIMARY KEY, aggregate_id UUID NOT NULL, seq INTEGER NOT NULL, applied INTEGER NOT NULL);
GRANT SELECT, UPDATE ON chaos.aggregates TO ` + producerRole + `;
GRANT SELECT, INSERT, UPDATE ON chaos.effects TO ` + consumerRole
	if _, err := db.admin.Exec(ctx, business); err != nil {
		return fmt.Errorf("create business tables: %w", err)
	}
	db.aggregates = make([]string, aggregates)
	for i := range db.aggregates {
		db.aggregates[i] = uuid.NewString()
	}
	if _, err := db.admin.Exec(ctx, "INSERT INTO chaos.aggregates (id) SELECT unnest($1::uuid[])", db.aggregates); err != nil {
		return fmt.Errorf("insert aggregates: %w", err)
	}
	return db.requirePasswords(ctx)
}

// requirePasswords makes the server, which trusts local connections,
// check the three roles' passwords.
func (db *database) requirePasswords(ctx context.Context) error {
	var hba string
	if err := db.admin.QueryRow(ctx, "SHOW hba_file").Scan(&hba); err != nil {
		return fmt.Errorf("find pg_hba.conf: %w", err)
	}
	old, err := os.ReadFile(hba)
	if err != nil {
		return fmt.Errorf("read pg_hba.conf: %w", err)
	}
	roles := relayRole + "," + producerRole + "," + consumerRole
	rule := "host all " + roles + " 127.0.0.1/32 scram-sha-256\n"
	if !bytes.Contains(old, []byte(rule)) {
		if err := os.WriteFile(hba, append([]byte(rule), old...), 0o600); err != nil {
			return fmt.Errorf("write pg_hba.conf: %w", err)
		}
	}
	if _, err := db.admin.Exec(ctx, "SELECT pg_reload_conf()"); err != nil {
		return fmt.Errorf("reload pg_hba.conf: %w", err)
	}
	// The reload is asynchronous: wait until a wrong password is refused.
	wrong, _ := url.Parse(db.relayURL)
	wrong.User = url.UserPassword(relayRole, "wrong")
	for deadline := time.Now().Add(10 * time.Second); ; {
		conn, err := pgx.Connect(ctx, wrong.String())
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "28P01" {
			return nil
		}
		if conn != nil {
			_ = conn.Close(ctx)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the server does not check passwords after reload (last: %v)", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (db *database) table() string {
	return pgx.Identifier{db.cfg.Schema, db.cfg.Table}.Sanitize()
}

// backlog counts committed events not yet dispatched.
func (db *database) backlog(ctx context.Context) (int, error) {
	var n int
	err := db.admin.QueryRow(ctx, "SELECT count(*) FROM "+db.table()+" WHERE dispatched_at IS NULL").Scan(&n)
	return n, err
}

// lag is the age of the oldest event waiting to be dispatched (parked
// ones aside), zero with none waiting.
func (db *database) lag(ctx context.Context) (time.Duration, error) {
	var secs float64
	err := db.admin.QueryRow(ctx, "SELECT coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 FROM "+
		db.table()+" WHERE dispatched_at IS NULL AND parked_at IS NULL").Scan(&secs)
	return time.Duration(secs * float64(time.Second)), err
}

func (db *database) committedCount(ctx context.Context) (int, error) {
	var n int
	err := db.admin.QueryRow(ctx, "SELECT count(*) FROM "+db.table()).Scan(&n)
	return n, err
}

func (db *database) committedUIDs(ctx context.Context) (map[string]bool, error) {
	rows, err := db.admin.Query(ctx, "SELECT event_id::text FROM "+db.table())
	if err != nil {
		return nil, fmt.Errorf("read committed events: %w", err)
	}
	uids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("read committed events: %w", err)
	}
	m := make(map[string]bool, len(uids))
	for _, u := range uids {
		m[u] = true
	}
	return m, nil
}

// effects returns how many events had an effect, and how many had it more
// than once.
func (db *database) effects(ctx context.Context) (applied, twice int, err error) {
	err = db.admin.QueryRow(ctx, "SELECT count(*), count(*) FILTER (WHERE applied > 1) FROM chaos.effects").Scan(&applied, &twice)
	return applied, twice, err
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
