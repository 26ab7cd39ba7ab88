package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// LogTable is the outbox table as the log relay (package logrelay) writes
// it: the marks of rows it published from the log, and the hand-off of
// events to the table relay. The statements live here, beside the claims,
// so that one package owns every statement on the table.
type LogTable struct {
	unhanded, handOffUnhanded     string
	markDone, dispatched          string
	handedOffOrDone               string
	handedOff, aggregateHandedOff string
	handRow, insertEvent          string
	insertUnreadable              string
	handOffPrefix                 string
	recordSlot, forgetSlot        string
	recordPosition, position      string
}

// Querier runs statements: a pgx.Tx, a *pgxpool.Pool or a *pgx.Conn.
type Querier interface {
	Execer
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// NewLogTable returns the log relay's statements on the table cfg names.
func NewLogTable(cfg Config) (*LogTable, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return nil, err
	}
	n := cfg.names()
	t := n.Outbox
	pending := `handoff_at IS NOT NULL AND dispatched_at IS NULL AND parked_at IS NULL`
	return &LogTable{
		handOffPrefix: handOffPrefix(cfg.Schema, cfg.Table),
		// Another slot's position is no position of this one.
		recordSlot: `INSERT INTO ` + n.LogSlot + ` AS s (slot_name, publication) VALUES ($1, $2)
ON CONFLICT (one) DO UPDATE SET slot_name = excluded.slot_name, publication = excluded.publication,
    confirmed_lsn = CASE WHEN s.slot_name = excluded.slot_name THEN s.confirmed_lsn END
WHERE (s.slot_name, s.publication) IS DISTINCT FROM (excluded.slot_name, excluded.publication)`,
		forgetSlot:     `DELETE FROM ` + n.LogSlot + ` WHERE slot_name = $1`,
		recordPosition: `UPDATE ` + n.LogSlot + ` SET confirmed_lsn = $2::text::pg_lsn WHERE slot_name = $1 AND (confirmed_lsn IS NULL OR confirmed_lsn < $2::text::pg_lsn)`,
		// A position past the server's WAL is not this cluster's (the row came
		// with a dump or a copy of another): it is no position at all.
		position:        `SELECT CASE WHEN confirmed_lsn <= pg_current_wal_lsn() THEN confirmed_lsn::text END FROM ` + n.LogSlot + ` WHERE slot_name = $1`,
		unhanded:        `SELECT COALESCE(array_agg(seq ORDER BY seq), '{}') FROM ` + t + ` WHERE dispatched_at IS NULL AND handoff_at IS NULL`,
		handOffUnhanded: `UPDATE ` + t + ` SET handoff_at = now() WHERE seq = ANY($1) AND dispatched_at IS NULL AND handoff_at IS NULL`,
		// The claim's mark, made safe to repeat: the log relay marks rows
		// it holds no lock on, which an operator may have marked since.
		markDone:           `UPDATE ` + t + ` SET dispatched_at = now(), retry_at = NULL WHERE seq = ANY($1) AND dispatched_at IS NULL RETURNING seq`,
		dispatched:         `SELECT seq FROM ` + t + ` WHERE seq = ANY($1) AND dispatched_at IS NOT NULL`,
		handedOffOrDone:    `SELECT EXISTS (SELECT 1 FROM ` + t + ` WHERE event_id = $1::uuid AND (handoff_at IS NOT NULL OR dispatched_at IS NOT NULL))`,
		handedOff:          `SELECT DISTINCT aggregate_id::text FROM ` + t + ` WHERE ` + pending,
		aggregateHandedOff: `SELECT EXISTS (SELECT 1 FROM ` + t + ` WHERE aggregate_id = $1 AND ` + pending + `)`,
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
		insertEvent: `INSERT INTO ` + t + ` (event_id, aggregate_id, type, payload, payload_bytes, content_type, topic, deliver_at,
    headers, created_at, handoff_at, attempts, last_error, retry_at, failed_at)
VALUES ($1, $2, $3, $4::text::json, $5, $6, $7, $8, $9::text::jsonb, $10, now(),
    CASE WHEN $11::text IS NULL THEN 0 ELSE $13::int END, $11,
    CASE WHEN $11::text IS NULL THEN $8 ELSE COALESCE($12::timestamptz, 'infinity') END,
    CASE WHEN $11::text IS NULL THEN NULL ELSE now() END)
ON CONFLICT (event_id) DO NOTHING`,
		// Under its own aggregate when the message names a valid one, so
		// the aggregate's later events follow it as they follow a poison
		// event.
		insertUnreadable: `INSERT INTO ` + t + ` (event_id, aggregate_id, type, payload, created_at, handoff_at, attempts, last_error, retry_at, failed_at)
VALUES (COALESCE($1::uuid, gen_random_uuid()), COALESCE($5, '00000000-0000-0000-0000-000000000000'), 'outbox.unreadable',
    json_build_object('message', $2::text), $3, now(), 1, $4, 'infinity', now())
ON CONFLICT (event_id) DO NOTHING`,
	}, nil
}

// RecordSlot records slot and publication as the ones the outbox's log
// relay reads: the log-only write function (migration 13) accepts writes
// only while that slot exists, permanent and valid.
func (l *LogTable) RecordSlot(ctx context.Context, db Execer, slot, publication string) error {
	if _, err := db.Exec(ctx, l.recordSlot, slot, publication); err != nil {
		return fmt.Errorf("record slot %s: %w", slot, err)
	}
	return nil
}

// ForgetSlot removes the record of slot (see RecordSlot), if it is the
// one recorded: log-only writes are refused from then on.
func (l *LogTable) ForgetSlot(ctx context.Context, db Execer, slot string) error {
	if _, err := db.Exec(ctx, l.forgetSlot, slot); err != nil {
		return fmt.Errorf("forget slot %s: %w", slot, err)
	}
	return nil
}

// RecordPosition records lsn as the last position the log relay
// confirmed on slot, unless a later one is recorded.
func (l *LogTable) RecordPosition(ctx context.Context, db Execer, slot, lsn string) error {
	if _, err := db.Exec(ctx, l.recordPosition, slot, lsn); err != nil {
		return fmt.Errorf("record position %s of slot %s: %w", lsn, slot, err)
	}
	return nil
}

// Position returns the position recorded for slot (see RecordPosition),
// "" when there is none.
func (l *LogTable) Position(ctx context.Context, db Querier, slot string) (string, error) {
	var lsn *string
	err := db.QueryRow(ctx, l.position, slot).Scan(&lsn)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return "", fmt.Errorf("read position of slot %s: %w", slot, err)
	}
	if lsn == nil {
		return "", nil
	}
	return *lsn, nil
}

// Unhanded lists the seqs of pending rows never handed off: what a new
// slot's snapshot sees and the slot will not read.
func (l *LogTable) Unhanded(ctx context.Context, db Querier) ([]int64, error) {
	var seqs []int64
	if err := db.QueryRow(ctx, l.unhanded).Scan(&seqs); err != nil {
		return nil, fmt.Errorf("list rows not handed off: %w", err)
	}
	return seqs, nil
}

// HandOffUnhanded hands the rows seqs to the table relay as they are
// (see Unhanded) and returns how many it handed.
func (l *LogTable) HandOffUnhanded(ctx context.Context, db Execer, seqs []int64) (int64, error) {
	tag, err := db.Exec(ctx, l.handOffUnhanded, seqs)
	if err != nil {
		return 0, fmt.Errorf("hand off %d rows: %w", len(seqs), err)
	}
	return tag.RowsAffected(), nil
}

// MarkDispatched marks the rows seqs dispatched and returns those it found
// neither pending nor dispatched already: not visible to this session
// yet, or deleted.
func (l *LogTable) MarkDispatched(ctx context.Context, db Querier, seqs []int64) (missing []int64, err error) {
	done, err := collect[int64](ctx, db, l.markDone, seqs)
	if err != nil {
		return nil, fmt.Errorf("mark rows dispatched: %w", err)
	}
	if len(done) == len(seqs) {
		return nil, nil
	}
	rest := without(seqs, done)
	seen, err := collect[int64](ctx, db, l.dispatched, rest)
	if err != nil {
		return nil, fmt.Errorf("mark rows dispatched: %w", err)
	}
	return without(rest, seen), nil
}

// Dispatched returns those of the rows seqs marked dispatched.
func (l *LogTable) Dispatched(ctx context.Context, db Querier, seqs []int64) ([]int64, error) {
	done, err := collect[int64](ctx, db, l.dispatched, seqs)
	if err != nil {
		return nil, fmt.Errorf("read rows dispatched: %w", err)
	}
	return done, nil
}

// HandedOffAggregates lists the aggregates with pending handed-off rows.
func (l *LogTable) HandedOffAggregates(ctx context.Context, db Querier) ([]string, error) {
	aggs, err := collect[string](ctx, db, l.handedOff)
	if err != nil {
		return nil, fmt.Errorf("list aggregates handed off: %w", err)
	}
	return aggs, nil
}

// AggregateHandedOff reports whether agg has pending handed-off rows.
func (l *LogTable) AggregateHandedOff(ctx context.Context, db Querier, agg string) (bool, error) {
	var pending bool
	if err := db.QueryRow(ctx, l.aggregateHandedOff, agg).Scan(&pending); err != nil {
		return false, fmt.Errorf("check aggregate %s handed off: %w", agg, err)
	}
	return pending, nil
}

// HandOffPrefix is the prefix of the logical messages by which replay,
// retry and unpark tell the log relay, in commit order, which aggregates
// they handed off (see ParseHandOff).
func (l *LogTable) HandOffPrefix() string { return l.handOffPrefix }

// ParseHandOff reads the aggregates a hand-off message names.
func ParseHandOff(content []byte) ([]string, error) {
	var aggs []string
	if err := json.Unmarshal(content, &aggs); err != nil {
		return nil, fmt.Errorf("read hand-off message: %w", err)
	}
	return aggs, nil
}

// Failed is why a handed-off event does not go out at once: held (a
// zero RetryAt) or retried at RetryAt, Attempts tries counted.
type Failed struct {
	Reason   string
	RetryAt  time.Time
	Attempts int
}

func (f *Failed) args() (reason *string, retryAt *time.Time, attempts int) {
	if f == nil {
		return nil, nil, 1
	}
	r := truncate(asText(f.Reason), 2000)
	if !f.RetryAt.IsZero() {
		return &r, &f.RetryAt, f.Attempts
	}
	return &r, nil, 1
}

// HandRow hands the row seq (event id) to the table relay, pending or,
// with f, failed. It returns the row's seq in the table from now on, or
// 0 when the row was not found pending: found reports whether it was
// handed off or dispatched already (a replay), and not found means its
// transaction is not visible to this session yet (or it was deleted).
func (l *LogTable) HandRow(ctx context.Context, db Querier, seq int64, id string, f *Failed) (newSeq int64, found bool, err error) {
	reason, retryAt, attempts := f.args()
	err = db.QueryRow(ctx, l.handRow, seq, reason, retryAt, attempts).Scan(&newSeq)
	if err == nil {
		return newSeq, true, nil
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return 0, false, fmt.Errorf("hand row %d to the table: %w", seq, err)
	}
	if err := db.QueryRow(ctx, l.handedOffOrDone, id).Scan(&found); err != nil {
		return 0, false, fmt.Errorf("hand row %d to the table: %w", seq, err)
	}
	return 0, found, nil
}

// LogEvent is an event read from a logical message, for the table.
type LogEvent struct {
	ID, AggregateID, Type, ContentType, Topic string
	Payload                                   []byte
	Headers                                   map[string]string
	CreatedAt                                 time.Time
	DeliverAt                                 time.Time // zero: due now
}

// RefusedError is an event the table's columns or checks refuse.
type RefusedError struct{ Msg string }

func (e *RefusedError) Error() string { return "the table refuses the event: " + e.Msg }

// InsertEvent inserts a log-only event into the table, handed to the
// table relay: pending or, with f, failed. An event already in the table
// is left as it is. Data the table refuses is a *RefusedError, and tx
// stays usable.
func (l *LogTable) InsertEvent(ctx context.Context, tx pgx.Tx, ev LogEvent, f *Failed) error {
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
	if IsJSON(ev.ContentType) {
		p := string(ev.Payload)
		payload = &p
	} else {
		payloadBytes = ev.Payload
	}
	var deliverAt *time.Time
	if !ev.DeliverAt.IsZero() {
		deliverAt = &ev.DeliverAt
	}
	reason, retryAt, attempts := f.args()
	err := savepoint(ctx, tx, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, l.insertEvent, ev.ID, ev.AggregateID, ev.Type, payload, payloadBytes,
			nullable(ev.ContentType), nullable(ev.Topic), deliverAt, headers, ev.CreatedAt, reason, retryAt, attempts)
		return err
	})
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code[:2] == "22" || pgErr.Code == "23514") {
		return &RefusedError{Msg: pgErr.Message}
	}
	if err != nil {
		return fmt.Errorf("insert event %s into the table: %w", ev.ID, err)
	}
	return nil
}

// Unreadable is a logical message that cannot be read as an event.
type Unreadable struct {
	Raw         []byte
	ID          string // the event id it names, if any
	AggregateID string // the aggregate it names, if any
	CreatedAt   time.Time
	Reason      string
}

// InsertUnreadable records u in the table, held, so that operators see it
// and its aggregate's later events wait behind it. An id that is not a
// UUID is replaced by a new one.
func (l *LogTable) InsertUnreadable(ctx context.Context, tx pgx.Tx, u Unreadable) error {
	var id, agg *string
	if u.ID != "" {
		text := asText(u.ID) // then not a UUID either: see below
		id = &text
	}
	if CheckKey(u.AggregateID) == nil {
		agg = &u.AggregateID
	}
	reason := truncate(asText(u.Reason), 2000)
	err := savepoint(ctx, tx, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, l.insertUnreadable, id, asText(string(u.Raw)), u.CreatedAt, reason, agg)
		return err
	})
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "22P02" && id != nil {
		_, err = tx.Exec(ctx, l.insertUnreadable, nil, asText(string(u.Raw)), u.CreatedAt, reason+" (event_id "+truncate(*id, 100)+")", agg)
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

func collect[T any](ctx context.Context, db Querier, sql string, args ...any) ([]T, error) {
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
