package logrelay

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// A logical slot lives on the primary. From PostgreSQL 17 on, a standby
// with sync_replication_slots keeps a copy of each failover slot, so a
// promoted standby has the slot and its position; before 17, or for a
// slot without failover, a failover loses the slot.

// failoverVersion is the first server_version_num with failover slots.
const failoverVersion = 170000

// makeFailover marks the slot a failover slot (PostgreSQL 17 and later).
// A slot is copied with failover off, and a temporary one cannot have it,
// so CreateSlot sets it on the copy; a relay sets it on a slot an earlier
// version created. The slot must be idle: else ErrSlotBusy.
func makeFailover(ctx context.Context, pool *pgxpool.Pool, name string) error {
	repl, err := replicationConn(ctx, pool, nil, 0)
	if err != nil {
		return fmt.Errorf("make slot %s a failover slot: %w", name, err)
	}
	defer repl.Close(context.WithoutCancel(ctx))
	return alterFailover(ctx, repl, name)
}

// alterFailover sets failover on the slot over a replication connection.
func alterFailover(ctx context.Context, repl *pgconn.PgConn, name string) error {
	_, err := repl.Exec(ctx, "ALTER_REPLICATION_SLOT "+pgx.Identifier{name}.Sanitize()+" (FAILOVER true)").ReadAll()
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "55006" { // object_in_use
		return fmt.Errorf("make slot %s a failover slot: %w (%s)", name, ErrSlotBusy, pgErr.Message)
	}
	if err != nil {
		return fmt.Errorf("make slot %s a failover slot: %w", name, err)
	}
	return nil
}

// ensureFailover makes the slot a failover slot, before the session
// reads it, where the server has them and it is not one yet (created by
// an earlier version, or a relay took it before CreateSlot could set it).
// A failure is logged, not fatal: the relay works without it, only a
// failover would lose the slot.
func (r *Relay) ensureFailover(ctx context.Context, conn *pgconn.PgConn) {
	made, err := r.setFailover(ctx, conn)
	switch {
	case err != nil:
		r.log.Warn("slot is not a failover slot: a standby promoted to primary will not have it", "slot", r.opts.Slot.Name, "error", err)
	case made:
		r.log.Info("slot made a failover slot: standbys with sync_replication_slots keep it", "slot", r.opts.Slot.Name)
	}
}

// setFailover makes the slot a failover slot where the server has them
// and it is not one yet; made says it did.
func (r *Relay) setFailover(ctx context.Context, conn *pgconn.PgConn) (made bool, err error) {
	version, err := serverVersion(ctx, r.pool)
	if err != nil || version < failoverVersion {
		return false, err
	}
	var failover bool
	err = r.pool.QueryRow(ctx, `SELECT coalesce((SELECT (to_jsonb(s) ->> 'failover')::boolean FROM pg_replication_slots s WHERE slot_name = $1), true)`,
		r.opts.Slot.Name).Scan(&failover)
	if err != nil || failover {
		return false, err
	}
	if err := alterFailover(ctx, conn, r.opts.Slot.Name); err != nil {
		return false, err
	}
	return true, nil
}

// serverVersion is the server's server_version_num (170000 for 17.0).
func serverVersion(ctx context.Context, pool *pgxpool.Pool) (int, error) {
	var v int
	err := pool.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&v)
	return v, err
}

// FailoverWarnings says what, as far as the primary shows, would lose
// the slot or events in a failover to one of its standbys: nothing when
// no physical standby streams from it. Before PostgreSQL 17 a failover
// loses the slot; from 17 on, without synchronized_standby_slots the
// relay can be sent events a standby has not received, which a failover
// to it loses from the database although they were published. The
// standby's own settings (sync_replication_slots, hot_standby_feedback,
// primary_slot_name) cannot be read from the primary.
func FailoverWarnings(ctx context.Context, pool *pgxpool.Pool) ([]string, error) {
	version, err := serverVersion(ctx, pool)
	if err != nil {
		return nil, fmt.Errorf("check failover settings: %w", err)
	}
	var standbys int
	var synced string
	// A walsender that no logical slot names streams WAL to a standby
	// (or to a base backup, which reports state backup).
	err = pool.QueryRow(ctx, `SELECT coalesce(current_setting('synchronized_standby_slots', true), ''),
       (SELECT count(*) FROM pg_stat_replication r WHERE r.state IS DISTINCT FROM 'backup'
          AND NOT EXISTS (SELECT 1 FROM pg_replication_slots s WHERE s.active_pid = r.pid AND s.slot_type = 'logical'))`).
		Scan(&synced, &standbys)
	if err != nil {
		return nil, fmt.Errorf("check failover settings: %w", err)
	}
	switch {
	case standbys == 0:
		return nil, nil
	case version < failoverVersion:
		return []string{fmt.Sprintf("PostgreSQL %d keeps logical replication slots on the primary only: "+
			"a failover to one of its %d standbys loses the slot and its position (PostgreSQL 17 and later synchronize failover slots)",
			version/10000, standbys)}, nil
	case synced == "":
		return []string{fmt.Sprintf("synchronized_standby_slots is empty while %d standbys stream from this server: "+
			"the relay can publish events a standby has not received, which a failover to it loses from the database, "+
			"and the standby's copy of the slot can lag; set it to the standbys' physical slots (primary_slot_name)", standbys)}, nil
	}
	return nil, nil
}
