package logrelay

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/store"
)

// ErrMixedModes is returned (wrapped) when table-mode and log-mode relays
// would both publish one outbox's rows: each row would go out twice, and
// out of order.
var ErrMixedModes = errors.New("table-mode and log-mode relays on one outbox")

// Each mode holds an advisory lock of its own, shared, for as long as it
// runs: a table-mode relay on a connection kept for it, a log relay on its
// replication connection (so the lock goes with its walsender). Each
// refuses to start while the other mode's lock is held, which it finds by
// trying to take that lock exclusively.
func modeLock(cfg store.Config, mode string) string {
	return "outbox " + mode + " mode " + cfg.Schema + "." + cfg.Table
}

// TableModeLock is a table-mode relay's hold on its outbox (see
// LockTableMode).
type TableModeLock struct {
	pool *pgxpool.Pool
	cfg  store.Config
	conn *pgxpool.Conn
}

// LockTableMode is for a table-mode relay: it takes the outbox's
// table-mode lock, which log relays refuse to start under, and fails with
// ErrMixedModes while a log relay reads the outbox's slot. Keep it for as
// long as the relay runs (see Watch); Release ends it.
func LockTableMode(ctx context.Context, pool *pgxpool.Pool, cfg store.Config) (*TableModeLock, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return nil, err
	}
	l := &TableModeLock{pool: pool, cfg: cfg}
	if err := l.take(ctx); err != nil {
		return nil, err
	}
	return l, nil
}

func (l *TableModeLock) take(ctx context.Context) error {
	conn, err := l.pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("take table-mode lock: %w", err)
	}
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock_shared(hashtextextended($1, 0))", modeLock(l.cfg, "table")); err != nil {
		conn.Release()
		return fmt.Errorf("take table-mode lock: %w", err)
	}
	if err := otherModeFree(ctx, conn.Conn().PgConn(), l.cfg, "log"); err != nil {
		// Closed, not returned to the pool: the lock goes with it.
		_ = conn.Hijack().Close(context.WithoutCancel(ctx))
		return err
	}
	l.conn = conn
	return nil
}

// Watch keeps the lock until ctx ends: every few seconds it checks the
// connection that holds it, and takes it again on a new one when that
// connection was lost (a server restart releases it), failing with
// ErrMixedModes if a log relay started meanwhile.
func (l *TableModeLock) Watch(ctx context.Context) error {
	t := time.NewTicker(5 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		if l.conn != nil {
			if err := l.conn.Ping(ctx); err == nil {
				continue
			}
			_ = l.conn.Hijack().Close(context.WithoutCancel(ctx))
			l.conn = nil
		}
		if err := l.take(ctx); errors.Is(err, ErrMixedModes) {
			return err
		}
	}
}

// Release lets the lock go. Call it once Watch has returned.
func (l *TableModeLock) Release() {
	if l.conn != nil {
		_ = l.conn.Hijack().Close(context.Background())
		l.conn = nil
	}
}

// otherModeFree fails with ErrMixedModes when a relay of mode other holds
// its lock on cfg's outbox. conn may be a replication connection: only
// the simple protocol is used.
func otherModeFree(ctx context.Context, conn *pgconn.PgConn, cfg store.Config, other string) error {
	key := store.Literal(modeLock(cfg, other))
	res, err := conn.Exec(ctx, "SELECT pg_try_advisory_lock(hashtextextended("+key+", 0))").ReadAll()
	if err != nil {
		return fmt.Errorf("check for %s-mode relays: %w", other, err)
	}
	if len(res) == 1 && len(res[0].Rows) == 1 && string(res[0].Rows[0][0]) == "t" {
		if _, err := conn.Exec(ctx, "SELECT pg_advisory_unlock(hashtextextended("+key+", 0))").ReadAll(); err != nil {
			return fmt.Errorf("check for %s-mode relays: %w", other, err)
		}
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

// lockLogMode takes the log-mode lock on the replication connection conn
// (it goes with its walsender), and fails with ErrMixedModes while a
// table-mode relay runs.
func lockLogMode(ctx context.Context, conn *pgconn.PgConn, cfg store.Config) error {
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock_shared(hashtextextended("+store.Literal(modeLock(cfg, "log"))+", 0))").ReadAll(); err != nil {
		return fmt.Errorf("take log-mode lock: %w", err)
	}
	return otherModeFree(ctx, conn, cfg, "table")
}
