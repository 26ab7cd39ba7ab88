package walrelay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/store"
)

// statements are the relay's writes to the outbox table.
type statements struct {
	slot, lockKey   string // the slot's name and advisory lock (see asHolder)
	markDone        string // published rows, dispatched
	dispatched      string // which of some rows this session sees dispatched
	handedOffOrDone string // whether a row (by event id) was handed off or dispatched
	visible         string // which of some transactions this session sees
	handedOff       string // aggregates with pending handed-off rows
	pendingAgg      string // whether one aggregate has some
	handRow         string // a row of the table to the table path: pending, or held with a reason
	insertMsg       string // a log-only event into the table: pending, or held
	insertBad       string // a message that cannot be read as an event, held
}

func newStatements(cfg store.Config, slot Slot) statements {
	t := pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize()
	pending := `handoff_at IS NOT NULL AND dispatched_at IS NULL AND parked_at IS NULL`
	return statements{
		slot: slot.Name, lockKey: lockKey(slot),
		markDone:        `UPDATE ` + t + ` SET dispatched_at = now(), retry_at = NULL WHERE seq = ANY($1) AND dispatched_at IS NULL RETURNING seq`,
		dispatched:      `SELECT seq FROM ` + t + ` WHERE seq = ANY($1) AND dispatched_at IS NOT NULL`,
		handedOffOrDone: `SELECT EXISTS (SELECT 1 FROM ` + t + ` WHERE event_id = $1::uuid AND (handoff_at IS NOT NULL OR dispatched_at IS NOT NULL))`,
		// The 32-bit xids the stream gives, widened to the xid8 nearest
		// the snapshot's xmax.
		visible: `SELECT x FROM unnest($1::bigint[]) AS x, pg_current_snapshot() AS s,
    LATERAL (SELECT pg_snapshot_xmax(s)::text::bigint AS xmax) m
WHERE pg_visible_in_snapshot((m.xmax + (x - m.xmax % 4294967296 + 6442450944) % 4294967296 - 2147483648)::text::xid8, s)`,
		handedOff:  `SELECT DISTINCT aggregate_id::text FROM ` + t + ` WHERE ` + pending,
		pendingAgg: `SELECT EXISTS (SELECT 1 FROM ` + t + ` WHERE aggregate_id = $1 AND ` + pending + `)`,
		// Held rows get the table relay's marks of a permanent failure;
		// a pending row keeps its retry_at, or waits for its deliver_at
		// (a row written without migration 7's trigger).
		// A row with a reason and a retry time ($3) failed transiently:
		// it is retried then ($4 attempts), not held.
		// A row handed off for the first time takes a fresh seq: the
		// table path publishes an aggregate's rows in seq order, and
		// seqs are taken at insert, not at commit, so only hand-off order
		// (the stream's, which is commit order) keeps an aggregate's
		// handed-off events in commit order, rows and messages alike.
		handRow: `UPDATE ` + t + ` SET handoff_at = now(),
    seq = CASE WHEN handoff_at IS NULL THEN nextval(pg_get_serial_sequence(` + literal(t) + `, 'seq')) ELSE seq END,
    attempts = attempts + CASE WHEN $2::text IS NULL THEN 0 ELSE $4::int END,
    last_error = COALESCE($2, last_error),
    retry_at = CASE WHEN $2::text IS NULL THEN COALESCE(retry_at, deliver_at) ELSE COALESCE($3::timestamptz, 'infinity') END,
    failed_at = CASE WHEN $2::text IS NULL THEN failed_at ELSE now() END
WHERE seq = $1 AND dispatched_at IS NULL
RETURNING seq`,
		// ON CONFLICT: a relay that crashed after the insert and before
		// confirming reads the event again. A pending event waits for its
		// deliver_at, as the table's trigger would have it.
		insertMsg: `INSERT INTO ` + t + ` (event_id, aggregate_id, type, payload, payload_bytes, content_type, topic, deliver_at,
    headers, created_at, handoff_at, attempts, last_error, retry_at, failed_at)
VALUES ($1, $2, $3, $4::text::json, $5, $6, $7, $8, $9::text::jsonb, $10, now(),
    CASE WHEN $11::text IS NULL THEN 0 ELSE $13::int END, $11,
    CASE WHEN $11::text IS NULL THEN $8 ELSE COALESCE($12::timestamptz, 'infinity') END,
    CASE WHEN $11::text IS NULL THEN NULL ELSE now() END)
ON CONFLICT (event_id) DO NOTHING`,
		// Under its own aggregate when the message names a valid one, so
		// the aggregate's later events follow it as they follow a poison
		// event.
		insertBad: `INSERT INTO ` + t + ` (event_id, aggregate_id, type, payload, created_at, handoff_at, attempts, last_error, retry_at, failed_at)
VALUES (COALESCE($1::uuid, gen_random_uuid()), COALESCE($5, '00000000-0000-0000-0000-000000000000'), 'outbox.unreadable',
    json_build_object('message', $2::text), $3, now(), 1, $4, 'infinity', now())
ON CONFLICT (event_id) DO NOTHING`,
	}
}

// mark marks the published rows items dispatched; gone counts those
// found neither pending nor dispatched: deleted since (see settle).
func (q statements) mark(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger, items []*item) (gone int, err error) {
	return q.settle(ctx, pool, log, "mark events dispatched", items, func(pending []*item) ([]*item, error) {
		seqs := make([]int64, len(pending))
		for i, it := range pending {
			seqs[i] = it.ev.Seq
		}
		rows, err := pool.Query(ctx, q.markDone, seqs)
		if err != nil {
			return nil, err
		}
		done, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil || len(done) == len(seqs) {
			return nil, err
		}
		// A row seen dispatched was dispatched already: a replay.
		rows, err = pool.Query(ctx, q.dispatched, without(seqs, done))
		if err != nil {
			return nil, err
		}
		seen, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			return nil, err
		}
		left := map[int64]bool{}
		for _, s := range without(without(seqs, done), seen) {
			left[s] = true
		}
		var missed []*item
		for _, it := range pending {
			if left[it.ev.Seq] {
				missed = append(missed, it)
			}
		}
		return missed, nil
	})
}

// settle applies a write to rows read from the stream until each is
// applied or known gone; apply returns the rows it missed. The stream can
// deliver a commit before the transaction is visible to other sessions
// (its commit record is flushed before it leaves the proc array, and with
// synchronous replication it stays invisible until a standby confirms
// it), so a missed row is tried again, for as long as that takes. It is
// gone (deleted since, as retention deletes rows dispatched earlier) only
// when apply misses it after its transaction was seen visible. Never
// giving up keeps the slot's position from passing an event nobody
// recorded.
func (q statements) settle(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger, what string, items []*item,
	apply func(pending []*item) ([]*item, error)) (gone int, err error) {
	pending := items
	visible := map[uint32]bool{} // transactions seen visible before the last apply
	start, warned := time.Now(), false
	for attempt := 0; ; attempt++ {
		missed, err := apply(pending)
		if err != nil {
			return gone, err
		}
		pending = pending[:0:0]
		for _, it := range missed {
			if visible[it.txn.xid] {
				gone++
			} else {
				pending = append(pending, it)
			}
		}
		if len(pending) == 0 {
			return gone, nil
		}
		if !warned && time.Since(start) > 5*time.Second {
			warned = true
			log.Warn("log relay: "+what+": rows not visible yet; waiting for their transactions to become visible (a synchronous standby that does not confirm holds them)",
				"rows", len(pending), "first_seq", pending[0].ev.Seq, "xid", pending[0].txn.xid, "waited", time.Since(start).Round(time.Millisecond))
		}
		xids := make([]int64, len(pending))
		for i, it := range pending {
			xids[i] = int64(it.txn.xid)
		}
		rows, err := pool.Query(ctx, q.visible, xids)
		if err != nil {
			return gone, err
		}
		seen, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			return gone, err
		}
		clear(visible)
		for _, x := range seen {
			visible[uint32(x)] = true
		}
		if !sleep(ctx, min(time.Duration(1+attempt)*4*time.Millisecond, time.Second)) {
			return gone, ctx.Err()
		}
	}
}

func without(all, some []int64) []int64 {
	drop := make(map[int64]bool, len(some))
	for _, s := range some {
		drop[s] = true
	}
	var out []int64
	for _, a := range all {
		if !drop[a] {
			out = append(out, a)
		}
	}
	return out
}

// errNotHolder is a hand-off refused because this session's walsender no
// longer holds the slot.
var errNotHolder = errors.New("this relay no longer holds the slot (another relay took it over): it hands nothing to the table")

// asHolder runs f in a transaction that holds the slot's lock, shared,
// and only while the walsender pid holds the slot. A relay that took the
// slot over lists the handed-off aggregates under that lock held
// exclusively, after its START_REPLICATION: so every hand-off of the
// relay before it either committed before that list was read, or finds
// the slot held by another walsender and is refused. A relay cut off from
// the server, still running, cannot hand an event over behind the new
// holder's back, which would then publish its aggregate's later events
// from the log ahead of it.
func (q statements) asHolder(ctx context.Context, pool *pgxpool.Pool, pid uint32, f func(tx pgx.Tx) error) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock_shared(hashtextextended($1, 0))", q.lockKey); err != nil {
			return err
		}
		var holds bool
		if err := tx.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND active_pid = $2)", q.slot, int64(pid)).Scan(&holds); err != nil {
			return err
		}
		if !holds {
			return errNotHolder
		}
		return f(tx)
	})
}

// savepoint runs f in a subtransaction: a statement that fails there
// leaves tx usable.
func savepoint(ctx context.Context, tx pgx.Tx, f func(tx pgx.Tx) error) error {
	sp, err := tx.Begin(ctx)
	if err != nil {
		return err
	}
	if err := f(sp); err != nil {
		_ = sp.Rollback(ctx)
		return err
	}
	return sp.Commit(ctx)
}

// handoff records it in the table for the table path: held with reason,
// or pending when reason is nil; pid is this session's walsender (see
// asHolder).
func (q statements) handoff(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger, pid uint32, it *item, reason error) error {
	var why *string
	var retryAt *time.Time
	attempts := 1
	if reason != nil {
		s := truncate(reason.Error(), 2000)
		why = &s
		if !it.retryAt.IsZero() {
			retryAt, attempts = &it.retryAt, it.ev.Attempts
		}
	}
	if it.row {
		// As in mark: the row may not be visible yet.
		_, err := q.settle(ctx, pool, log, "hand event to the table", []*item{it}, func([]*item) ([]*item, error) {
			var seq int64
			var seen bool
			err := q.asHolder(ctx, pool, pid, func(tx pgx.Tx) error {
				err := tx.QueryRow(ctx, q.handRow, it.ev.Seq, why, retryAt, attempts).Scan(&seq)
				if !errors.Is(err, pgx.ErrNoRows) {
					return err
				}
				// seen: handed off (under a new seq) or dispatched
				// already, a replay.
				return tx.QueryRow(ctx, q.handedOffOrDone, it.ev.ID).Scan(&seen)
			})
			switch {
			case err != nil:
				return nil, err
			case seq != 0:
				it.ev.Seq = seq // its seq in the table from now on
			case !seen:
				return []*item{it}, nil
			}
			return nil, nil
		})
		if err != nil {
			return fmt.Errorf("hand row %d to the table: %w", it.ev.Seq, err)
		}
		return nil
	}
	return q.asHolder(ctx, pool, pid, func(tx pgx.Tx) error { return q.insertEvent(ctx, tx, it, why, retryAt, attempts, reason) })
}

// insertEvent inserts a log-only event into the table (see handoff).
func (q statements) insertEvent(ctx context.Context, tx pgx.Tx, it *item, why *string, retryAt *time.Time, attempts int, reason error) error {
	if it.bad == nil {
		var headers *string
		if it.ev.Headers != nil {
			b, _ := jsonMarshal(it.ev.Headers)
			s := string(b)
			headers = &s
		}
		var payload *string
		var payloadBytes []byte
		if store.IsJSON(it.ev.ContentType) {
			p := string(it.ev.Payload)
			payload = &p
		} else {
			payloadBytes = it.ev.Payload
		}
		var deliverAt *time.Time
		if !it.deliverAt.IsZero() {
			deliverAt = &it.deliverAt
		}
		err := savepoint(ctx, tx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, q.insertMsg, it.ev.ID, it.ev.AggregateID, it.ev.Type, payload, payloadBytes,
				nullable(it.ev.ContentType), nullable(it.ev.Topic), deliverAt, headers, it.ev.CreatedAt, why, retryAt, attempts)
			return err
		})
		var pgErr *pgconn.PgError
		// Data the table's columns or checks refuse, which DecodeMessage
		// let through: held as unreadable instead, so the stream never
		// stops on it.
		if !errors.As(err, &pgErr) || (pgErr.Code[:2] != "22" && pgErr.Code != "23514") {
			if err != nil {
				return fmt.Errorf("insert event %s into the table: %w", it.ev.ID, err)
			}
			return nil
		}
		r := fmt.Sprintf("the table refuses the event: %s", pgErr.Message)
		if reason != nil {
			r = reason.Error() + "; " + r
		}
		reason = errors.New(r)
	}
	var id *string
	if it.ev.ID != "" {
		id = &it.ev.ID
	}
	var agg *string
	if store.CheckKey(it.ev.AggregateID) == nil {
		agg = &it.ev.AggregateID
	}
	why2 := truncate(reason.Error(), 2000)
	err := savepoint(ctx, tx, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, q.insertBad, id, string(it.raw), it.ev.CreatedAt, why2, agg)
		return err
	})
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "22P02" && id != nil {
		// The event_id itself is not a UUID: give the row a new one.
		_, err = tx.Exec(ctx, q.insertBad, nil, string(it.raw), it.ev.CreatedAt, why2+" (event_id "+truncate(*id, 100)+")", agg)
	}
	if err != nil {
		return fmt.Errorf("insert unreadable event message into the table: %w", err)
	}
	return nil
}

// literal quotes s as an SQL string literal.
func literal(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// nullable is s, or NULL when empty.
func nullable(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// truncate cuts s to at most n bytes without splitting a UTF-8 sequence.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && s[n]&0xC0 == 0x80 {
		n--
	}
	return s[:n]
}
