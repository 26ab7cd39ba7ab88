package logrelay

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outboxhq/outbox/store"
)

// lockLogMode takes the log-mode lock (store.ModeLock) on the replication
// connection conn, so that it goes with its walsender, and fails with
// store.ErrMixedModes while a table-mode relay runs.
func lockLogMode(ctx context.Context, conn *pgconn.PgConn, cfg store.Config) error {
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock_shared(hashtextextended("+store.Literal(store.ModeLock(cfg, "log"))+", 0))").ReadAll(); err != nil {
		return fmt.Errorf("take log-mode lock: %w", err)
	}
	return store.OtherModeFree(ctx, conn, cfg, "table")
}
