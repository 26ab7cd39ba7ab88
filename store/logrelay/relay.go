package logrelay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store"
)

// Relay publishes the events of a replication slot. Run it in each
// replica: one holds the slot, the others stand by.
type Relay struct {
	pool   *pgxpool.Pool
	pub    core.Publisher
	opts   Options
	log    *slog.Logger
	obs    core.Observer
	prefix string
	sql    statements

	holding  atomic.Bool
	inFlight atomic.Int64
	progress atomic.Int64 // unix nanos of the last status sent or standby attempt
	// advanced is when the confirmed position last moved, or the stream
	// was last seen with nothing in flight: what a stall is counted from.
	advanced atomic.Int64
	failure  atomic.Pointer[string] // the last session's error; nil while streaming or standing by
	current  atomic.Pointer[stream] // the session's stream while it reads the slot

	unitsName string // core.Settler's name of the stream's unit
	ledger    ledger // the log-only events read, for core.Settler
}

// New returns a relay reading the slot over pool's server and publishing
// to pub; it does not start it.
func New(pool *pgxpool.Pool, pub core.Publisher, opts Options) (*Relay, error) {
	if pool == nil || pub == nil {
		return nil, errors.New("new log relay: pool and publisher are required")
	}
	o, err := opts.WithDefaults()
	if err != nil {
		return nil, fmt.Errorf("new log relay: %w", err)
	}
	prefix, err := MessagePrefix(o.Store)
	if err != nil {
		return nil, fmt.Errorf("new log relay: %w", err)
	}
	sql, err := newStatements(o.Store, o.Slot)
	if err != nil {
		return nil, fmt.Errorf("new log relay: %w", err)
	}
	return &Relay{pool: pool, pub: pub, opts: o, log: o.Logger, obs: o.Observer, prefix: prefix, sql: sql,
		unitsName: o.Store.Schema + "." + o.Store.Table + ".log"}, nil
}

// Options returns the relay's options with defaults filled in.
func (r *Relay) Options() Options { return r.opts }

// Holding reports whether this relay reads the slot now.
func (r *Relay) Holding() bool { return r.holding.Load() }

// InFlight is the number of events read and not yet done.
func (r *Relay) InFlight() int64 { return r.inFlight.Load() }

// LastProgress is when the relay last confirmed its position to the
// server or, standing by, last tried to take the slot over.
func (r *Relay) LastProgress() time.Time {
	n := r.progress.Load()
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n)
}

// Ready reports, for a readiness probe, whether the log relay does its
// work: "log" fails while its replication session fails (a standby that
// finds the slot held is ready), and "log_progress" when, reading the slot
// with events in flight, it has confirmed nothing for staleAfter (a
// broker that takes nothing, a stuck mark).
func (r *Relay) Ready(staleAfter time.Duration) []core.Check {
	var sessionErr error
	if msg := r.failure.Load(); msg != nil {
		sessionErr = fmt.Errorf("replication session failing: %s", *msg)
	}
	checks := []core.Check{{Name: "log", Err: sessionErr}}
	var stalled error
	if r.Holding() {
		if n, age := r.InFlight(), time.Since(time.Unix(0, r.advanced.Load())); n > 0 && staleAfter > 0 && age > staleAfter {
			stalled = fmt.Errorf("no event confirmed for %s with %d in flight (limit %s)", age.Round(time.Second), n, staleAfter)
		}
	}
	return append(checks, core.Check{Name: "log_progress", Err: stalled})
}

// Run relays until ctx is cancelled, then lets the in-flight events
// finish (bounded by ShutdownTimeout), confirms and returns nil. It
// returns an error only for what retrying cannot fix: the server's
// wal_level, the role's missing REPLICATION attribute, a missing slot
// with ManualSlot, a slot of the name that decodes another database.
func (r *Relay) Run(ctx context.Context) error {
	if err := r.prepare(ctx); err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("log relay: %w", err)
	}
	var st sessions
	for ctx.Err() == nil {
		streamed, err := r.session(ctx)
		if ctx.Err() != nil {
			return nil
		}
		wait, err := r.afterSession(ctx, &st, streamed, err)
		if err != nil {
			return err
		}
		if wait > 0 && !sleep(ctx, wait) {
			return nil
		}
	}
	return nil
}

// prepare checks the server and the role, fills in the default slot
// name and warns of failover settings that would lose the slot.
func (r *Relay) prepare(ctx context.Context) error {
	if err := Check(ctx, r.pool); err != nil {
		return err
	}
	// The default slot name depends on the database; it is read once,
	// before any session uses it. The statements name the slot too (a
	// hand-off checks that this session holds it, under its lock): built
	// in New with the name still empty, they would refuse every hand-off.
	if r.opts.Slot.Name == "" {
		slot, err := r.opts.Slot.Resolve(ctx, r.pool, r.opts.Store)
		if err != nil {
			return err
		}
		r.opts.Slot = slot
		if r.sql, err = newStatements(r.opts.Store, r.opts.Slot); err != nil {
			return err
		}
	}
	if warnings, err := FailoverWarnings(ctx, r.pool); err != nil {
		r.log.Warn("log relay: could not check the failover settings", "error", err)
	} else {
		for _, w := range warnings {
			r.log.Warn("log relay: a failover would lose the slot or events", "slot", r.opts.Slot.Name, "reason", w)
		}
	}
	return nil
}

// sessions is what Run keeps from one session to the next.
type sessions struct {
	failures int  // sessions failed in a row
	standing bool // standing by, the slot held by another relay (logged once)
	created  bool // the slot was created, or found, since a session last streamed
}

// afterSession says what follows a session that ended with err (streamed:
// it held the slot): the wait before the next one, none after creating
// the missing slot, or the error that ends Run, for what retrying cannot
// fix.
func (r *Relay) afterSession(ctx context.Context, st *sessions, streamed bool, err error) (time.Duration, error) {
	if streamed {
		*st = sessions{}
	}
	if err == nil || errors.Is(err, ErrSlotBusy) {
		r.failure.Store(nil)
	} else {
		msg := err.Error()
		r.failure.Store(&msg)
	}
	switch {
	case errors.Is(err, ErrSlotBusy):
		if !st.standing {
			r.log.Info("slot held by another relay; standing by", "slot", r.opts.Slot.Name, "detail", err)
			st.standing = true
		}
		r.progress.Store(time.Now().UnixNano())
		st.failures = 0
		return r.opts.StandbyInterval, nil
	case errors.Is(err, ErrSlotOfOtherDatabase):
		return 0, fmt.Errorf("log relay: %w", err)
	case errors.Is(err, ErrNoSlot) && st.created:
		// Created (or found) and still missing: never loop on it.
		return 0, fmt.Errorf("log relay: slot %s is missing right after it was created: %w", r.opts.Slot.Name, err)
	case errors.Is(err, ErrNoSlot) && !r.opts.ManualSlot:
		st.created = true
		if err = r.createSlot(ctx); err == nil {
			return 0, nil
		}
	}
	if errors.Is(err, ErrNoSlot) {
		return 0, fmt.Errorf("log relay: %w (create it with `outbox slot create`)", err)
	}
	if errors.Is(err, ErrSlotLost) || errors.Is(err, ErrNotPublished) || errors.Is(err, ErrPublicationFiltered) || errors.Is(err, store.ErrMixedModes) {
		r.obs.Errored("replication", err)
		r.log.Error("log relay stopped: retrying cannot fix this", "slot", r.opts.Slot.Name, "publication", r.opts.Slot.Publication, "error", err)
		return 0, fmt.Errorf("log relay: %w", err)
	}
	st.failures++
	wait := r.opts.ErrorBackoff.Delay(st.failures - 1)
	r.obs.Errored("replication", err)
	r.log.Error("log relay stream failed", "error", err, "retry_in", wait, "failures", st.failures)
	return wait, nil
}

// createSlot creates the missing slot (see CreateSlot) and wakes the
// table path when it handed rows off.
func (r *Relay) createSlot(ctx context.Context) error {
	c, err := CreateSlot(ctx, r.pool, r.opts.Store, r.opts.Slot)
	if err != nil {
		return err
	}
	r.log.Info("slot created", "slot", r.opts.Slot.Name, "publication", r.opts.Slot.Publication,
		"publication_created", c.Publication, "rows_handed_to_table", c.HandedOff)
	if c.HandedOff > 0 && r.opts.HandedOff != nil {
		r.opts.HandedOff()
	}
	return nil
}

// session reads the slot over one replication connection until the
// connection fails or ctx is done. streamed says it held the slot.
func (r *Relay) session(ctx context.Context) (streamed bool, err error) {
	// Bounded: a server behind a cut network would keep the connect or
	// the first queries waiting forever.
	sctx, cancel := context.WithTimeout(ctx, r.opts.ReceiveTimeout)
	defer cancel()
	conn, err := r.connect(sctx)
	if err != nil {
		return false, err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()
	start, err := r.startPosition(sctx)
	if err != nil {
		return false, err
	}
	if err := r.checkPublication(sctx); err != nil {
		return false, err
	}
	r.ensureFailover(sctx, conn)
	if err := lockLogMode(sctx, conn, r.opts.Store); err != nil {
		return false, err
	}
	if err := r.startReplication(sctx, conn, start); err != nil {
		return false, err
	}
	s, err := r.newStream(sctx, conn, start)
	if err != nil {
		return false, err
	}
	cancel()
	// Readiness tells the present: this session streams, so the failure
	// of an earlier one (such as the slot it has since created) is over.
	r.failure.Store(nil)
	r.advanced.Store(time.Now().UnixNano())
	r.holding.Store(true)
	defer r.holding.Store(false)
	r.log.Info("reading slot", "slot", r.opts.Slot.Name, "from", start.String(), "handed_off_aggregates", len(s.handedOff))
	r.current.Store(s)
	defer r.current.Store(nil)
	return true, s.run(ctx)
}

// connect opens the session's replication connection.
func (r *Relay) connect(ctx context.Context) (*pgconn.PgConn, error) {
	// The decoding reads values as text: in the formats it parses,
	// whatever the role's or database's settings.
	params := map[string]string{"application_name": r.opts.ApplicationName, "bytea_output": "hex", "DateStyle": "ISO"}
	if r.opts.WALSenderTimeout > 0 {
		params["wal_sender_timeout"] = fmt.Sprintf("%dms", r.opts.WALSenderTimeout.Milliseconds())
	}
	return replicationConn(ctx, r.pool, params, r.opts.ReceiveTimeout)
}

// startPosition is where the session's stream starts: the slot's
// confirmed position or, when later, the position the relay recorded.
func (r *Relay) startPosition(ctx context.Context) (pglogrepl.LSN, error) {
	start, err := r.slotPosition(ctx)
	if err != nil {
		return 0, err
	}
	// After a crash of the server its slot can be behind what the relay
	// confirmed: it resumes from the later position, and the server skips
	// the transactions committed before it.
	rec, err := r.sql.position(ctx, r.pool, r.opts.Slot.Name)
	if err != nil || rec == "" {
		return start, err
	}
	lsn, err := pglogrepl.ParseLSN(rec)
	if err != nil {
		return 0, fmt.Errorf("read position of slot %s: %w", r.opts.Slot.Name, err)
	}
	return max(start, lsn), nil
}

// startReplication starts the slot's stream from start, over the
// publication, with the messages of pg_logical_emit_message.
func (r *Relay) startReplication(ctx context.Context, conn *pgconn.PgConn, start pglogrepl.LSN) error {
	pub := strings.ReplaceAll(pgx.Identifier{r.opts.Slot.Publication}.Sanitize(), "'", "''")
	err := pglogrepl.StartReplication(ctx, conn, r.opts.Slot.Name, start, pglogrepl.StartReplicationOptions{
		Mode:       pglogrepl.LogicalReplication,
		PluginArgs: []string{"proto_version '1'", "publication_names '" + pub + "'", "messages 'true'"},
	})
	if err == nil {
		return nil
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case "55006": // object_in_use
			return fmt.Errorf("%w: %s", ErrSlotBusy, pgErr.Message)
		case "42704": // undefined_object
			return fmt.Errorf("%w: %s", ErrNoSlot, pgErr.Message)
		case "55000": // object_not_in_prerequisite_state
			if strings.Contains(pgErr.Message, "can no longer get changes") {
				return fmt.Errorf("%w: slot %s: %s (%s); recreate it with `outbox slot drop` and `outbox slot create`",
					ErrSlotLost, r.opts.Slot.Name, pgErr.Message, pgErr.Detail)
			}
		}
	}
	return fmt.Errorf("start replication from slot %s: %w", r.opts.Slot.Name, err)
}

// newStream is the session's stream, from start, once the slot is its
// own.
func (r *Relay) newStream(ctx context.Context, conn *pgconn.PgConn, start pglogrepl.LSN) (*stream, error) {
	s := &stream{r: r, conn: conn, tracker: newTracker(start), relations: map[uint32]*pglogrepl.RelationMessage{},
		stopping: make(chan struct{})}
	// Taken once the slot is this session's: whoever read it before is
	// gone, having read no further.
	var horizon string
	if err := r.pool.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&horizon); err != nil {
		return nil, fmt.Errorf("read the server's WAL position: %w", err)
	}
	var err error
	if s.horizon, err = pglogrepl.ParseLSN(horizon); err != nil {
		return nil, fmt.Errorf("read the server's WAL position: %w", err)
	}
	r.ledger.newSession(s.horizon)
	// Listed only once the slot is this session's (see asHolder): a
	// relay that held it before can have handed off events until then.
	if s.handedOff, err = r.loadHandedOff(ctx); err != nil {
		return nil, err
	}
	s.sweepAt = max(minSweep, 2*len(s.handedOff))
	// Held by this session, the slot is the outbox's: recorded for the
	// log-only write function (a slot made before the record existed).
	if err := r.sql.recordSlot(ctx, r.pool, r.opts.Slot.Name, r.opts.Slot.Publication); err != nil {
		r.log.Warn("log relay: the slot is not recorded, so log-only writes are refused until `outbox slot create` records it", "slot", r.opts.Slot.Name, "error", err)
	}
	return s, nil
}

// slotPosition reads the slot's confirmed position, where its stream
// resumes.
func (r *Relay) slotPosition(ctx context.Context) (pglogrepl.LSN, error) {
	var plugin string
	var lsn, db, walStatus *string
	var here bool
	err := r.pool.QueryRow(ctx, `SELECT plugin, confirmed_flush_lsn::text, database, database IS NOT DISTINCT FROM current_database(), wal_status
FROM pg_replication_slots WHERE slot_name = $1`, r.opts.Slot.Name).Scan(&plugin, &lsn, &db, &here, &walStatus)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, fmt.Errorf("%w: slot %s in this database", ErrNoSlot, r.opts.Slot.Name)
	}
	if err != nil {
		return 0, fmt.Errorf("read slot %s: %w", r.opts.Slot.Name, err)
	}
	if !here {
		return 0, otherDatabase(r.opts.Slot.Name, deref(db))
	}
	if plugin != "pgoutput" {
		return 0, fmt.Errorf("slot %s uses plugin %s, not pgoutput", r.opts.Slot.Name, plugin)
	}
	if walStatus != nil && *walStatus == "lost" {
		return 0, fmt.Errorf("%w: slot %s has wal_status lost (it fell behind max_slot_wal_keep_size and the server removed WAL it needed); "+
			"events committed after its confirmed position %s may never be relayed: find them (rows: outbox status; log-only events are gone with the WAL), "+
			"then recreate the slot with `outbox slot drop` and `outbox slot create`, which hands pending rows to the table path",
			ErrSlotLost, r.opts.Slot.Name, deref(lsn))
	}
	if lsn == nil {
		return 0, fmt.Errorf("slot %s has no confirmed position", r.opts.Slot.Name)
	}
	return pglogrepl.ParseLSN(*lsn)
}

// checkPublication fails with ErrNotPublished unless the slot's
// publication publishes inserts into the outbox table.
func (r *Relay) checkPublication(ctx context.Context) error {
	var ok, rowFilter, columnList bool
	// Row filters and column lists (PostgreSQL 15+) are columns of
	// pg_publication_rel read by name, so one statement serves every
	// version.
	table := pgx.Identifier{r.opts.Store.Schema, r.opts.Store.Table}.Sanitize()
	// The publication's tables come from pg_get_publication_tables, as
	// pg_publication_tables does, matched by oid: the view matches by
	// name through pg_class, and the generic plan of a statement run each
	// status (from its sixth run) read every relation of that name, a
	// hundredth of a second on a server that created and dropped many.
	err := r.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_publication p, pg_get_publication_tables(p.pubname) t
WHERE p.pubname = $1 AND p.pubinsert AND t.relid = to_regclass($2)),
       COALESCE(bool_or(to_jsonb(r) ->> 'prqual' IS NOT NULL), false), COALESCE(bool_or(to_jsonb(r) ->> 'prattrs' IS NOT NULL), false)
FROM pg_publication_rel r JOIN pg_publication p ON p.oid = r.prpubid
WHERE p.pubname = $1 AND r.prrelid = to_regclass($2)`,
		r.opts.Slot.Publication, table).Scan(&ok, &rowFilter, &columnList)
	if err != nil {
		return fmt.Errorf("check publication %s: %w", r.opts.Slot.Publication, err)
	}
	if rowFilter || columnList {
		what := "a row filter"
		if columnList {
			what = "a column list"
		}
		return fmt.Errorf("%w: publication %s has %s on %s, so the slot's stream would skip rows or columns the relay needs: "+
			"publish the whole table (ALTER PUBLICATION %s SET TABLE %s); rows skipped meanwhile are not in the stream: "+
			"recreating the slot (`outbox slot drop`, `outbox slot create`) hands pending rows to the table path",
			ErrPublicationFiltered, r.opts.Slot.Publication, what, table, pgx.Identifier{r.opts.Slot.Publication}.Sanitize(), table)
	}
	if !ok {
		return fmt.Errorf("%w: publication %s does not publish inserts into %s, so the slot's stream carries none of its rows: "+
			"restore it (ALTER PUBLICATION %s ADD TABLE %s, publish 'insert'); rows inserted meanwhile are not in the stream: "+
			"recreating the slot (`outbox slot drop`, `outbox slot create`) hands pending rows to the table path",
			ErrNotPublished, r.opts.Slot.Publication, table, pgx.Identifier{r.opts.Slot.Publication}.Sanitize(), table)
	}
	return nil
}

// sleep waits d; false when ctx ended first.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
