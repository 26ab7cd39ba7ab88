package store

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// ErrMixedModes is returned (wrapped) when table-mode and log-mode relays
// would both publish one outbox's rows: each row would go out twice, and
// out of order.
var ErrMixedModes = errors.New("table-mode and log-mode relays on one outbox")

// ModeLock is the key of mode's advisory lock on cfg's outbox (mode
// "table" or "log"; cfg with its defaults filled in). Each mode holds its
// lock, shared, for as long as it runs: the table source on a connection
// kept for it, a log relay on its replication connection (so the lock
// goes with its walsender). Each refuses to start while the other mode's
// lock is held, which it finds by trying to take that lock exclusively
// (OtherModeFree). The key stays as it is: relays of older and newer
// releases must exclude each other.
func ModeLock(cfg Config, mode string) string {
	return "outbox " + mode + " mode " + cfg.Schema + "." + cfg.Table
}

// OtherModeFree fails with ErrMixedModes when a relay of mode other holds
// its lock on cfg's outbox. conn may be a replication connection: only
// the simple protocol is used. It reads the server's lock table rather
// than trying the lock: a try takes the lock for a moment, and relays of
// one mode starting together would each find it taken by another.
func OtherModeFree(ctx context.Context, conn *pgconn.PgConn, cfg Config, other string) error {
	key := Literal(ModeLock(cfg, other))
	res, err := conn.Exec(ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks
WHERE locktype = 'advisory' AND objsubid = 1 AND granted AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND ((classid::bigint << 32) | objid::bigint) = hashtextextended(`+key+`, 0))`).ReadAll()
	if err != nil {
		return fmt.Errorf("check for %s-mode relays: %w", other, err)
	}
	if len(res) == 1 && len(res[0].Rows) == 1 && string(res[0].Rows[0][0]) == "f" {
		return nil
	}
	table := pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize()
	if other == "log" {
		return fmt.Errorf("%w: a log relay reads %s's slot, so a table-mode relay would publish every row a second time: "+
			"run one mode (relay.mode), stopping the other's relays first", ErrMixedModes, table)
	}
	return fmt.Errorf("%w: a table-mode relay publishes %s, so a log relay would publish every row a second time: "+
		"stop the table-mode relays before switching to relay.mode log", ErrMixedModes, table)
}
