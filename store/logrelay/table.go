package logrelay

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
	"github.com/outboxhq/outbox/store"
)

// logTable is the outbox table as the log relay writes it: the marks of
// rows it published from the log, and the hand-off of events to the table
// path.
type logTable struct {
	unhandedSQL, handOffUnhandedSQL     string
	markDoneSQL, dispatchedSQL          string
	dealtWithSQL                        string
	handedOffOrDoneSQL                  string
	handedOffSQL, aggregateHandedOffSQL string
	handRowSQL, insertEventSQL          string
	insertUnreadableSQL                 string
	recordSlotSQL, forgetSlotSQL        string
	recordPositionSQL, positionSQL      string
	settledSQL                          string
	// handOffPrefix is the prefix of the logical messages by which
	// replay, retry and unpark tell the log relay, in commit order, which
	// aggregates they handed off (see parseHandOff).
	handOffPrefix string
}

// querier runs statements: a pgx.Tx, a *pgxpool.Pool or a *pgx.Conn.
type querier interface {
	store.DBTX
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// newLogTable returns the log relay's statements on the table cfg names.
func newLogTable(cfg store.Config) (*logTable, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return nil, err
	}
	n := cfg.Names()
	t := n.Outbox
	pending := `handoff_at IS NOT NULL AND dispatched_at IS NULL AND parked_at IS NULL`
	return &logTable{
		handOffPrefix: store.HandOffPrefix(cfg.Schema, cfg.Table),
		settledSQL:    settledSQL(n),
		// Another slot's position is no position of this one.
		recordSlotSQL: `INSERT INTO ` + n.LogSlot + ` AS s (slot_name, publication) VALUES ($1, $2)
ON CONFLICT (one) DO UPDATE SET slot_name = excluded.slot_name, publication = excluded.publication,
    confirmed_lsn = CASE WHEN s.slot_name = excluded.slot_name THEN s.confirmed_lsn END
WHERE (s.slot_name, s.publication) IS DISTINCT FROM (excluded.slot_name, excluded.publication)`,
		forgetSlotSQL:     `DELETE FROM ` + n.LogSlot + ` WHERE slot_name = $1`,
		recordPositionSQL: `UPDATE ` + n.LogSlot + ` SET confirmed_lsn = $2::text::pg_lsn WHERE slot_name = $1 AND (confirmed_lsn IS NULL OR confirmed_lsn < $2::text::pg_lsn)`,
		// A position past the server's WAL is not this cluster's (the row came
		// with a dump or a copy of another): it is no position at all.
		positionSQL:        `SELECT CASE WHEN confirmed_lsn <= pg_current_wal_lsn() THEN confirmed_lsn::text END FROM ` + n.LogSlot + ` WHERE slot_name = $1`,
		unhandedSQL:        `SELECT COALESCE(array_agg(seq ORDER BY seq), '{}') FROM ` + t + ` WHERE dispatched_at IS NULL AND handoff_at IS NULL`,
		handOffUnhandedSQL: `UPDATE ` + t + ` SET handoff_at = now() WHERE seq = ANY($1) AND dispatched_at IS NULL AND handoff_at IS NULL`,
		// The claim's mark, made safe to repeat: the log relay marks rows
		// it holds no lock on, which an operator may have marked since.
		// A row an operator replayed since its insert went out is the
		// replay's, for the table path to publish: the stream, reading
		// that insert again, neither marks it nor publishes it again.
		markDoneSQL:           `UPDATE ` + t + ` SET dispatched_at = now(), retry_at = NULL WHERE seq = ANY($1) AND dispatched_at IS NULL AND replays = 0 RETURNING seq`,
		dispatchedSQL:         `SELECT seq FROM ` + t + ` WHERE seq = ANY($1) AND (dispatched_at IS NOT NULL OR replays > 0)`,
		dealtWithSQL:          `SELECT event_id::text FROM ` + t + ` WHERE event_id = ANY($1::uuid[]) AND (dispatched_at IS NOT NULL OR handoff_at IS NOT NULL OR replays > 0)`,
		handedOffOrDoneSQL:    `SELECT EXISTS (SELECT 1 FROM ` + t + ` WHERE event_id = $1::uuid AND (handoff_at IS NOT NULL OR dispatched_at IS NOT NULL))`,
		handedOffSQL:          `SELECT DISTINCT aggregate_id::text FROM ` + t + ` WHERE ` + pending,
		aggregateHandedOffSQL: `SELECT EXISTS (SELECT 1 FROM ` + t + ` WHERE aggregate_id = $1 AND ` + pending + `)`,
		// Held rows get the table relay's marks of a permanent failure;
		// a pending row keeps its retry_at, or waits for its deliver_at
		// (a row written without migration 7's trigger). A row with a
		// reason and a retry time ($3) failed transiently: it is retried
		// then ($4 attempts), not held.
		// A row handed off for the first time takes a fresh seq: the
		// table path publishes an aggregate's rows in seq order, and
		// seqs are taken at insert, not at commit, so only hand-off order
		// (the stream's, which is commit order) keeps an aggregate's
		// handed-off events in commit order, rows and messages alike.
		handRowSQL: `UPDATE ` + t + ` SET handoff_at = now(),
    seq = CASE WHEN handoff_at IS NULL THEN nextval(pg_get_serial_sequence(` + store.Literal(t) + `, 'seq')) ELSE seq END,
    attempts = attempts + CASE WHEN $2::text IS NULL THEN 0 ELSE $4::int END,
    last_error = COALESCE($2, last_error),
    retry_at = CASE WHEN $2::text IS NULL THEN COALESCE(retry_at, deliver_at) ELSE COALESCE($3::timestamptz, 'infinity') END,
    failed_at = CASE WHEN $2::text IS NULL THEN failed_at ELSE now() END
WHERE seq = $1 AND dispatched_at IS NULL
RETURNING seq`,
		// ON CONFLICT: a relay that crashed after the insert and before
		// confirming reads the event again. A pending event waits for its
		// deliver_at, as the table's trigger would have it.
		insertEventSQL: `INSERT INTO ` + t + ` (event_id, aggregate_id, type, payload, payload_bytes, content_type, topic, deliver_at,
    headers, created_at, handoff_at, attempts, last_error, retry_at, failed_at)
VALUES ($1, $2, $3, $4::text::json, $5, $6, $7, $8, $9::text::jsonb, $10, now(),
    CASE WHEN $11::text IS NULL THEN 0 ELSE $13::int END, $11,
    CASE WHEN $11::text IS NULL THEN $8 ELSE COALESCE($12::timestamptz, 'infinity') END,
    CASE WHEN $11::text IS NULL THEN NULL ELSE now() END)
ON CONFLICT (event_id) DO NOTHING`,
		// Under its own aggregate when the message names a valid one, so
		// the aggregate's later events follow it as they follow a poison
		// event.
		insertUnreadableSQL: `INSERT INTO ` + t + ` (event_id, aggregate_id, type, payload, created_at, handoff_at, attempts, last_error, retry_at, failed_at)
VALUES (COALESCE($1::uuid, gen_random_uuid()), COALESCE($5, '00000000-0000-0000-0000-000000000000'), 'outbox.unreadable',
    json_build_object('message', $2::text), $3, now(), 1, $4, 'infinity', now())
ON CONFLICT (event_id) DO NOTHING`,
	}, nil
}

// recordSlot records slot and publication as the ones the outbox's log
// relay reads: the log-only write function (migration 13) accepts writes
// only while that slot exists, permanent and valid.
func (l *logTable) recordSlot(ctx context.Context, db store.DBTX, slot, publication string) error {
	if _, err := db.Exec(ctx, l.recordSlotSQL, slot, publication); err != nil {
		return fmt.Errorf("record slot %s: %w", slot, err)
	}
	return nil
}

// forgetSlot removes the record of slot (see recordSlot), if it is the
// one recorded: log-only writes are refused from then on.
func (l *logTable) forgetSlot(ctx context.Context, db store.DBTX, slot string) error {
	if _, err := db.Exec(ctx, l.forgetSlotSQL, slot); err != nil {
		return fmt.Errorf("forget slot %s: %w", slot, err)
	}
	return nil
}

// recordPosition records lsn as the last position the log relay
// confirmed on slot, unless a later one is recorded.
func (l *logTable) recordPosition(ctx context.Context, db store.DBTX, slot, lsn string) error {
	if _, err := db.Exec(ctx, l.recordPositionSQL, slot, lsn); err != nil {
		return fmt.Errorf("record position %s of slot %s: %w", lsn, slot, err)
	}
	return nil
}

// position returns the position recorded for slot (see recordPosition),
// "" when there is none.
func (l *logTable) position(ctx context.Context, db querier, slot string) (string, error) {
	var lsn *string
	err := db.QueryRow(ctx, l.positionSQL, slot).Scan(&lsn)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return "", fmt.Errorf("read position of slot %s: %w", slot, err)
	}
	if lsn == nil {
		return "", nil
	}
	return *lsn, nil
}

// unhanded lists the seqs of pending rows never handed off: what a new
// slot's snapshot sees and the slot will not read.
func (l *logTable) unhanded(ctx context.Context, db querier) ([]int64, error) {
	var seqs []int64
	if err := db.QueryRow(ctx, l.unhandedSQL).Scan(&seqs); err != nil {
		return nil, fmt.Errorf("list rows not handed off: %w", err)
	}
	return seqs, nil
}

// handOffUnhanded hands the rows seqs to the table path as they are
// (see unhanded) and returns how many it handed.
func (l *logTable) handOffUnhanded(ctx context.Context, db store.DBTX, seqs []int64) (int64, error) {
	tag, err := db.Exec(ctx, l.handOffUnhandedSQL, seqs)
	if err != nil {
		return 0, fmt.Errorf("hand off %d rows: %w", len(seqs), err)
	}
	return tag.RowsAffected(), nil
}

// markDispatched marks the rows seqs dispatched and returns those it found
// neither pending nor dispatched already: not visible to this session
// yet, or deleted.
func (l *logTable) markDispatched(ctx context.Context, db querier, seqs []int64) (missing []int64, err error) {
	done, err := collect[int64](ctx, db, l.markDoneSQL, seqs)
	if err != nil {
		return nil, fmt.Errorf("mark rows dispatched: %w", err)
	}
	if len(done) == len(seqs) {
		return nil, nil
	}
	rest := without(seqs, done)
	seen, err := collect[int64](ctx, db, l.dispatchedSQL, rest)
	if err != nil {
		return nil, fmt.Errorf("mark rows dispatched: %w", err)
	}
	return without(rest, seen), nil
}

// dealtWith returns those of the event ids (canonical UUIDs) the table
// shows published (dispatched, or replayed since) or handed off to it.
func (l *logTable) dealtWith(ctx context.Context, db querier, ids []string) ([]string, error) {
	done, err := collect[string](ctx, db, l.dealtWithSQL, ids)
	if err != nil {
		return nil, fmt.Errorf("read events dealt with: %w", err)
	}
	return done, nil
}

// dispatched returns those of the rows seqs marked dispatched, or
// replayed since: their insert went out before the replay.
func (l *logTable) dispatched(ctx context.Context, db querier, seqs []int64) ([]int64, error) {
	done, err := collect[int64](ctx, db, l.dispatchedSQL, seqs)
	if err != nil {
		return nil, fmt.Errorf("read rows dispatched: %w", err)
	}
	return done, nil
}

// handedOffAggregates lists the aggregates with pending handed-off rows.
func (l *logTable) handedOffAggregates(ctx context.Context, db querier) ([]string, error) {
	aggs, err := collect[string](ctx, db, l.handedOffSQL)
	if err != nil {
		return nil, fmt.Errorf("list aggregates handed off: %w", err)
	}
	return aggs, nil
}

// aggregateHandedOff reports whether agg has pending handed-off rows.
func (l *logTable) aggregateHandedOff(ctx context.Context, db querier, agg string) (bool, error) {
	var pending bool
	if err := db.QueryRow(ctx, l.aggregateHandedOffSQL, agg).Scan(&pending); err != nil {
		return false, fmt.Errorf("check aggregate %s handed off: %w", agg, err)
	}
	return pending, nil
}

// parseHandOff reads the aggregates a hand-off message names.
func parseHandOff(content []byte) ([]string, error) {
	var aggs []string
	if err := json.Unmarshal(content, &aggs); err != nil {
		return nil, fmt.Errorf("read hand-off message: %w", err)
	}
	return aggs, nil
}

// failureArgs are the statements' arguments for why a handed-off event
// does not go out at once: f nil, it does; held (a zero RetryAt); or
// retried at RetryAt, attempts tries counted.
func failureArgs(f *core.Failure, attempts int) (reason *string, retryAt *time.Time, tries int) {
	if f == nil {
		return nil, nil, 1
	}
	r := store.Reason(f.Reason)
	if !f.RetryAt.IsZero() {
		return &r, &f.RetryAt, attempts
	}
	return &r, nil, 1
}

// handRow hands the row seq (event id) to the table path, pending or,
// with f, failed (attempts tries counted). It returns the row's seq in the table from now on, or
// 0 when the row was not found pending: found reports whether it was
// handed off or dispatched already (a replay), and not found means its
// transaction is not visible to this session yet (or it was deleted).
func (l *logTable) handRow(ctx context.Context, db querier, seq int64, id string, f *core.Failure, attempts int) (newSeq int64, found bool, err error) {
	reason, retryAt, tries := failureArgs(f, attempts)
	err = db.QueryRow(ctx, l.handRowSQL, seq, reason, retryAt, tries).Scan(&newSeq)
	if err == nil {
		return newSeq, true, nil
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return 0, false, fmt.Errorf("hand row %d to the table: %w", seq, err)
	}
	if err := db.QueryRow(ctx, l.handedOffOrDoneSQL, id).Scan(&found); err != nil {
		return 0, false, fmt.Errorf("hand row %d to the table: %w", seq, err)
	}
	return 0, found, nil
}

// logEvent is an event read from a logical message, for the table.
type logEvent struct {
	ID, AggregateID, Type, ContentType, Topic string
	Payload                                   []byte
	Headers                                   map[string]string
	CreatedAt                                 time.Time
	DeliverAt                                 time.Time // zero: due now
}

// refusedError is an event the table's columns or checks refuse.
type refusedError struct{ msg string }

func (e *refusedError) Error() string { return "the table refuses the event: " + e.msg }

// insertEvent inserts a log-only event into the table, handed to the
// table path: pending or, with f, failed (attempts tries counted). An
// event already in the table is left as it is. Data the table refuses is
// a *refusedError, and tx stays usable.
func (l *logTable) insertEvent(ctx context.Context, tx pgx.Tx, ev logEvent, f *core.Failure, attempts int) error {
	var headers *string
	if ev.Headers != nil {
		b, err := json.Marshal(ev.Headers)
		if err != nil {
			return fmt.Errorf("insert event %s: encode headers: %w", ev.ID, err)
		}
		s := string(b)
		headers = &s
	}
	var payload *string
	var payloadBytes []byte
	if event.IsJSON(ev.ContentType) {
		p := string(ev.Payload)
		payload = &p
	} else {
		payloadBytes = ev.Payload
	}
	var deliverAt *time.Time
	if !ev.DeliverAt.IsZero() {
		deliverAt = &ev.DeliverAt
	}
	reason, retryAt, tries := failureArgs(f, attempts)
	err := savepoint(ctx, tx, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, l.insertEventSQL, ev.ID, ev.AggregateID, ev.Type, payload, payloadBytes,
			nullable(ev.ContentType), nullable(ev.Topic), deliverAt, headers, ev.CreatedAt, reason, retryAt, tries)
		return err
	})
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code[:2] == "22" || pgErr.Code == "23514") {
		return &refusedError{msg: pgErr.Message}
	}
	if err != nil {
		return fmt.Errorf("insert event %s into the table: %w", ev.ID, err)
	}
	return nil
}

// unreadable is a logical message that cannot be read as an event.
type unreadable struct {
	Raw         []byte
	ID          string // the event id it names, if any
	AggregateID string // the aggregate it names, if any
	CreatedAt   time.Time
	Reason      string
}

// insertUnreadable records u in the table, held, so that operators see it
// and its aggregate's later events wait behind it. An id that is not a
// UUID is replaced by a new one.
func (l *logTable) insertUnreadable(ctx context.Context, tx pgx.Tx, u unreadable) error {
	var id, agg *string
	if u.ID != "" {
		text := store.AsText(u.ID) // then not a UUID either: see below
		id = &text
	}
	if event.CheckKey(u.AggregateID) == nil {
		agg = &u.AggregateID
	}
	reason := store.Reason(u.Reason)
	err := savepoint(ctx, tx, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, l.insertUnreadableSQL, id, store.AsText(string(u.Raw)), u.CreatedAt, reason, agg)
		return err
	})
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "22P02" && id != nil {
		_, err = tx.Exec(ctx, l.insertUnreadableSQL, nil, store.AsText(string(u.Raw)), u.CreatedAt, reason+" (event_id "+event.Truncate(*id, 100)+")", agg)
	}
	if err != nil {
		return fmt.Errorf("insert unreadable event message into the table: %w", err)
	}
	return nil
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

func collect[T any](ctx context.Context, db querier, sql string, args ...any) ([]T, error) {
	rows, err := db.Query(ctx, sql, args...)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[T])
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

func nullable(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}
