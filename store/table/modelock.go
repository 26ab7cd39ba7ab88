package table

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/store"
)

// modeLockCheck is how often Hold checks the connection that holds the
// table-mode lock.
const modeLockCheck = 5 * time.Second

// Hold implements core.Holder: a relay over the source claims only while
// it holds the outbox's table-mode lock (store.ModeLock), shared with the
// outbox's other table-mode relays, which log relays refuse to start
// under. Hold fails with store.ErrMixedModes while a log relay reads the
// outbox's slot: both would publish every row. The lock is held on a
// connection of its own, checked every few seconds; when that connection
// is lost (a server restart releases the lock) Hold takes the lock again
// on a new one, failing with store.ErrMixedModes if a log relay started
// meanwhile. Other errors (the database out of reach) are retried. A
// source of log mode's table path (NewHandOff) holds nothing.
func (s *Source) Hold(ctx context.Context, held func()) error {
	if s.handOff {
		held()
		<-ctx.Done()
		return nil
	}
	var conn *pgxpool.Conn
	defer func() {
		if conn != nil {
			// Closed, not returned to the pool: the lock goes with it.
			_ = conn.Hijack().Close(context.WithoutCancel(ctx))
		}
	}()
	t := time.NewTicker(modeLockCheck)
	defer t.Stop()
	for {
		if conn != nil && conn.Ping(ctx) != nil && ctx.Err() == nil {
			_ = conn.Hijack().Close(context.WithoutCancel(ctx))
			conn = nil
		}
		if conn == nil && ctx.Err() == nil {
			c, err := s.takeModeLock(ctx)
			switch {
			case errors.Is(err, store.ErrMixedModes):
				return err
			case err != nil:
				if ctx.Err() == nil {
					s.log.Warn("table-mode lock not taken; trying again", "error", err, "in", modeLockCheck)
				}
			default:
				conn = c
				held()
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// takeModeLock takes the table-mode lock on a connection of its own and
// returns the connection, unless a log relay holds the log-mode lock.
func (s *Source) takeModeLock(ctx context.Context) (*pgxpool.Conn, error) {
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("take table-mode lock: %w", err)
	}
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock_shared(hashtextextended($1, 0))", store.ModeLock(s.cfg, "table")); err != nil {
		conn.Release()
		return nil, fmt.Errorf("take table-mode lock: %w", err)
	}
	if err := store.OtherModeFree(ctx, conn.Conn().PgConn(), s.cfg, "log"); err != nil {
		// Closed, not returned to the pool: the lock goes with it.
		_ = conn.Hijack().Close(context.WithoutCancel(ctx))
		return nil, err
	}
	return conn, nil
}
