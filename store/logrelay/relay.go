package logrelay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store"
)

// Options configure a Relay. The zero value is valid: every unset field
// takes the default named in its comment.
type Options struct {
	Store store.Config // the outbox's names and event limits; defaults as in store.Config
	Slot  Slot         // defaults as in Slot
	// ManualSlot leaves the slot to an operator (`outbox slot create`):
	// Run fails when it is missing. By default the relay creates the
	// publication and the slot (see CreateSlot), as the binary does.
	ManualSlot bool

	// Options are the engine's, core's, with their defaults: Lanes,
	// BatchSize (events per claim from the stream, and rows marked
	// dispatched per statement), PublishTimeout, RetryBackoff (an event
	// failing transiently is retried in place, holding its aggregate and
	// the slot's position back), HandOffAfter (then it moves to the
	// table, its aggregate's later events following it, and the slot's
	// position moves past it), ErrorBackoff (also for reconnects),
	// ShutdownTimeout, Logger and Observer. Unordered is refused: the
	// log relay keeps each aggregate's order.
	core.Options

	// MaxInFlight bounds the events read from the slot and not yet done
	// (published and recorded); past it the relay stops reading, so a
	// broker outage holds memory still. Default 10000.
	MaxInFlight int
	// MaxInFlightBytes bounds their payload and header bytes the same
	// way; default 64 MiB. One event is always let in.
	MaxInFlightBytes int
	// StandbyInterval is how often a relay that waits for the slot tries
	// to take it over; default 1s.
	StandbyInterval time.Duration
	// StatusInterval is how often the relay sends its position to the
	// server and asks for a reply; an idle slot's position advances with
	// it. A position that moved is confirmed within 100ms (or this, when
	// shorter) anyway. Default 1s.
	StatusInterval time.Duration
	// ReceiveTimeout is how long the relay waits for any message from
	// the server (each status asks for one) before it counts the
	// connection as dead, drops it and its in-flight events, and starts
	// over; default 15s, more than StatusInterval.
	ReceiveTimeout time.Duration
	// WALSenderTimeout is the server's wal_sender_timeout for this
	// relay's connection: how long the server keeps the slot for a relay
	// that stopped answering (paused, cut off) before a standby can take
	// it over. Default 10s; negative keeps the server's setting
	// (PostgreSQL's default is 60s).
	WALSenderTimeout time.Duration
	// ApplicationName is the replication connection's application_name;
	// default "outbox-log-relay".
	ApplicationName string
	// HandedOff, when set, is called after the relay handed events to the
	// table path, to wake its relay (core.Relay.Wake).
	HandedOff func()
}

// WithDefaults returns o with every unset field at its default, or an
// error naming the first field out of range.
func (o Options) WithDefaults() (Options, error) {
	var err error
	if o.Store, err = o.Store.WithDefaults(); err != nil {
		return o, fmt.Errorf("log relay options: %w", err)
	}
	if len(o.Store.Table)+len("_handoff") > 47 {
		return o, fmt.Errorf("log relay options: table name %q is longer than 39 bytes, too long for its handoff view", o.Store.Table)
	}
	if o.Slot, err = o.Slot.WithDefaults(o.Store); err != nil {
		return o, fmt.Errorf("log relay options: %w", err)
	}
	if o.Unordered {
		return o, errors.New("log relay options: Unordered is invalid, want false: the log relay keeps each aggregate's order")
	}
	if o.Options, err = o.Options.WithDefaults(); err != nil {
		return o, fmt.Errorf("log relay options: %w", err)
	}
	checks := []struct {
		name, want string
		bad        bool
	}{
		{"MaxInFlight", "not negative", o.MaxInFlight < 0},
		{"MaxInFlightBytes", "not negative", o.MaxInFlightBytes < 0},
		{"StandbyInterval", "not negative", o.StandbyInterval < 0},
		{"StatusInterval", "not negative", o.StatusInterval < 0},
		{"ReceiveTimeout", "not negative", o.ReceiveTimeout < 0},
	}
	for _, c := range checks {
		if c.bad {
			return o, fmt.Errorf("log relay options: %s is invalid, want %s", c.name, c.want)
		}
	}
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	defDur := func(v *time.Duration, d time.Duration) {
		if *v == 0 {
			*v = d
		}
	}
	def(&o.MaxInFlight, 10000)
	def(&o.MaxInFlightBytes, 64<<20)
	defDur(&o.StandbyInterval, time.Second)
	defDur(&o.StatusInterval, time.Second)
	defDur(&o.ReceiveTimeout, 15*time.Second)
	defDur(&o.WALSenderTimeout, 10*time.Second)
	if o.ReceiveTimeout <= o.StatusInterval {
		return o, fmt.Errorf("log relay options: ReceiveTimeout %s must exceed StatusInterval %s", o.ReceiveTimeout, o.StatusInterval)
	}
	if o.WALSenderTimeout > 0 && o.WALSenderTimeout <= o.StatusInterval {
		// The server ends a session that sends no status for this long.
		return o, fmt.Errorf("log relay options: WALSenderTimeout %s must exceed StatusInterval %s", o.WALSenderTimeout, o.StatusInterval)
	}
	if o.ApplicationName == "" {
		o.ApplicationName = "outbox-log-relay"
	}
	return o, nil
}

// HandOffConfig is the store configuration of the table path of log
// mode: a store.Store (and a core.Relay over it) built with it claims
// only the rows the log relay handed off, through the handoff view of
// migration 8, and never the rows the log relay publishes itself.
func HandOffConfig(cfg store.Config) (store.Config, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return cfg, err
	}
	cfg.Table += "_handoff"
	if _, err := cfg.WithDefaults(); err != nil {
		return cfg, fmt.Errorf("handoff view of %s: %w", cfg.Table, err)
	}
	return cfg, nil
}

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
	return &Relay{pool: pool, pub: pub, opts: o, log: o.Logger, obs: o.Observer, prefix: prefix, sql: sql}, nil
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
	if err := Check(ctx, r.pool); err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("log relay: %w", err)
	}
	// The default slot name depends on the database; it is read once,
	// before any session uses it. The statements name the slot too (a
	// hand-off checks that this session holds it, under its lock): built
	// in New with the name still empty, they would refuse every hand-off.
	if r.opts.Slot.Name == "" {
		slot, err := r.opts.Slot.Resolve(ctx, r.pool, r.opts.Store)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("log relay: %w", err)
		}
		r.opts.Slot = slot
		if r.sql, err = newStatements(r.opts.Store, r.opts.Slot); err != nil {
			return fmt.Errorf("log relay: %w", err)
		}
	}
	if warnings, err := FailoverWarnings(ctx, r.pool); err != nil {
		r.log.Warn("log relay: could not check the failover settings", "error", err)
	} else {
		for _, w := range warnings {
			r.log.Warn("log relay: a failover would lose the slot or events", "slot", r.opts.Slot.Name, "reason", w)
		}
	}
	failures, standing, created := 0, false, false
	for ctx.Err() == nil {
		streamed, err := r.session(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if streamed {
			failures, standing, created = 0, false, false
		}
		if err == nil || errors.Is(err, ErrSlotBusy) {
			r.failure.Store(nil)
		} else {
			msg := err.Error()
			r.failure.Store(&msg)
		}
		wait := r.opts.StandbyInterval
		switch {
		case errors.Is(err, ErrSlotBusy):
			if !standing {
				r.log.Info("slot held by another relay; standing by", "slot", r.opts.Slot.Name, "detail", err)
				standing = true
			}
			r.progress.Store(time.Now().UnixNano())
			failures = 0
		case errors.Is(err, ErrSlotOfOtherDatabase):
			return fmt.Errorf("log relay: %w", err)
		case errors.Is(err, ErrNoSlot) && created:
			// Created (or found) and still missing: never loop on it.
			return fmt.Errorf("log relay: slot %s is missing right after it was created: %w", r.opts.Slot.Name, err)
		case errors.Is(err, ErrNoSlot) && !r.opts.ManualSlot:
			created = true
			c, cerr := CreateSlot(ctx, r.pool, r.opts.Store, r.opts.Slot)
			if cerr == nil {
				r.log.Info("slot created", "slot", r.opts.Slot.Name, "publication", r.opts.Slot.Publication,
					"publication_created", c.Publication, "rows_handed_to_table", c.HandedOff)
				if c.HandedOff > 0 && r.opts.HandedOff != nil {
					r.opts.HandedOff()
				}
				continue
			}
			err = cerr
			fallthrough
		default:
			if errors.Is(err, ErrNoSlot) {
				return fmt.Errorf("log relay: %w (create it with `outbox slot create`)", err)
			}
			if errors.Is(err, ErrSlotLost) || errors.Is(err, ErrNotPublished) || errors.Is(err, ErrPublicationFiltered) || errors.Is(err, ErrMixedModes) {
				r.obs.Errored("replication", err)
				r.log.Error("log relay stopped: retrying cannot fix this", "slot", r.opts.Slot.Name, "publication", r.opts.Slot.Publication, "error", err)
				return fmt.Errorf("log relay: %w", err)
			}
			failures++
			wait = r.opts.ErrorBackoff.Delay(failures - 1)
			r.obs.Errored("replication", err)
			r.log.Error("log relay stream failed", "error", err, "retry_in", wait, "failures", failures)
		}
		if !sleep(ctx, wait) {
			return nil
		}
	}
	return nil
}

// session reads the slot over one replication connection until the
// connection fails or ctx is done. streamed says it held the slot.
func (r *Relay) session(ctx context.Context) (streamed bool, err error) {
	// The decoding reads values as text: in the formats it parses,
	// whatever the role's or database's settings.
	params := map[string]string{"application_name": r.opts.ApplicationName, "bytea_output": "hex", "DateStyle": "ISO"}
	if r.opts.WALSenderTimeout > 0 {
		params["wal_sender_timeout"] = fmt.Sprintf("%dms", r.opts.WALSenderTimeout.Milliseconds())
	}
	// Bounded: a server behind a cut network would keep the connect or
	// the first queries waiting forever.
	sctx, cancel := context.WithTimeout(ctx, r.opts.ReceiveTimeout)
	defer cancel()
	conn, err := replicationConn(sctx, r.pool, params, r.opts.ReceiveTimeout)
	if err != nil {
		return false, err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()
	start, err := r.slotPosition(sctx)
	if err != nil {
		return false, err
	}
	// After a crash of the server its slot can be behind what the relay
	// confirmed: it resumes from the later position, and the server skips
	// the transactions committed before it.
	if rec, err := r.sql.Position(sctx, r.pool, r.opts.Slot.Name); err != nil {
		return false, err
	} else if rec != "" {
		lsn, err := pglogrepl.ParseLSN(rec)
		if err != nil {
			return false, fmt.Errorf("read position of slot %s: %w", r.opts.Slot.Name, err)
		}
		start = max(start, lsn)
	}
	if err := r.checkPublication(sctx); err != nil {
		return false, err
	}
	r.ensureFailover(sctx, conn)
	if err := lockLogMode(sctx, conn, r.opts.Store); err != nil {
		return false, err
	}
	s := &stream{r: r, conn: conn, tracker: newTracker(start), relations: map[uint32]*pglogrepl.RelationMessage{},
		stopping: make(chan struct{}), sweepAt: minSweep}
	pub := strings.ReplaceAll(pgx.Identifier{r.opts.Slot.Publication}.Sanitize(), "'", "''")
	err = pglogrepl.StartReplication(sctx, conn, r.opts.Slot.Name, start, pglogrepl.StartReplicationOptions{
		Mode:       pglogrepl.LogicalReplication,
		PluginArgs: []string{"proto_version '1'", "publication_names '" + pub + "'", "messages 'true'"},
	})
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) {
			switch pgErr.Code {
			case "55006": // object_in_use
				return false, fmt.Errorf("%w: %s", ErrSlotBusy, pgErr.Message)
			case "42704": // undefined_object
				return false, fmt.Errorf("%w: %s", ErrNoSlot, pgErr.Message)
			case "55000": // object_not_in_prerequisite_state
				if strings.Contains(pgErr.Message, "can no longer get changes") {
					return false, fmt.Errorf("%w: slot %s: %s (%s); recreate it with `outbox slot drop` and `outbox slot create`",
						ErrSlotLost, r.opts.Slot.Name, pgErr.Message, pgErr.Detail)
				}
			}
		}
		return false, fmt.Errorf("start replication from slot %s: %w", r.opts.Slot.Name, err)
	}
	// Taken once the slot is this session's: whoever read it before is
	// gone, having read no further.
	var horizon string
	if err := r.pool.QueryRow(sctx, "SELECT pg_current_wal_lsn()::text").Scan(&horizon); err != nil {
		return false, fmt.Errorf("read the server's WAL position: %w", err)
	}
	if s.horizon, err = pglogrepl.ParseLSN(horizon); err != nil {
		return false, fmt.Errorf("read the server's WAL position: %w", err)
	}
	// Listed only once the slot is this session's (see asHolder): a
	// relay that held it before can have handed off events until then.
	if s.handedOff, err = r.loadHandedOff(sctx); err != nil {
		return false, err
	}
	// Held by this session, the slot is the outbox's: recorded for the
	// log-only write function (a slot made before the record existed).
	if err := r.sql.RecordSlot(sctx, r.pool, r.opts.Slot.Name, r.opts.Slot.Publication); err != nil {
		r.log.Warn("log relay: the slot is not recorded, so log-only writes are refused until `outbox slot create` records it", "slot", r.opts.Slot.Name, "error", err)
	}
	cancel()
	// Readiness tells the present: this session streams, so the failure
	// of an earlier one (such as the slot it has since created) is over.
	r.failure.Store(nil)
	r.advanced.Store(time.Now().UnixNano())
	r.holding.Store(true)
	defer r.holding.Store(false)
	s.sweepAt = max(minSweep, 2*len(s.handedOff))
	r.log.Info("reading slot", "slot", r.opts.Slot.Name, "from", start.String(), "handed_off_aggregates", len(s.handedOff))
	r.current.Store(s)
	defer r.current.Store(nil)
	return true, s.run(ctx)
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

// loadHandedOff lists the aggregates with pending handed-off rows, whose
// later events must follow them through the table. It waits for a
// CreateSlot that is still handing rows off, and for the hand-offs in
// progress of the relay that held the slot before (see asHolder).
func (r *Relay) loadHandedOff(ctx context.Context) (map[string]handOffNote, error) {
	out := map[string]handOffNote{}
	err := pgx.BeginFunc(ctx, r.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", lockKey(r.opts.Slot)); err != nil {
			return err
		}
		aggs, err := r.sql.HandedOffAggregates(ctx, tx)
		for _, a := range aggs {
			out[a] = handOffNote{}
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("list aggregates handed to the table: %w", err)
	}
	return out, nil
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

// stream is one session's reading of the slot. The reader (run) owns the
// connection and confirms positions; the events it reads wait in the
// stream's buffer, from which a core.Relay, the engine, claims them (see
// source.go).
type stream struct {
	r         *Relay
	conn      *pgconn.PgConn
	tracker   *tracker
	relations map[uint32]*pglogrepl.RelationMessage
	engine    *core.Relay
	marks     *marker // marks the published rows of every claim

	// horizon is the end of the server's WAL when this session took the
	// slot: a relay that read it before read nothing past it.
	horizon pglogrepl.LSN

	// reader state
	txn        *txn
	commitTime time.Time
	received   pglogrepl.LSN
	confirmed  pglogrepl.LSN // the position last sent as flushed
	statusAt   time.Time     // when a status was last sent

	// clockOffset is the server's clock minus this host's (nanoseconds),
	// from the send time of the server's last message: deliver-at times
	// are the database's, compared with its clock.
	clockOffset atomic.Int64

	freed  chan struct{} // a token whenever an event is done
	bytes  atomic.Int64  // payload bytes in flight
	events atomic.Int64

	// stopping is closed when the server is shutting down (serverStops).
	stopping  chan struct{}
	stopOnce  sync.Once
	stopCause error

	mu       sync.Mutex
	buffered []*item // read, not yet claimed
	// handedOff holds the aggregates whose events go to the table (see
	// handOffNote). Entries go when a lookup or a sweep finds the
	// aggregate with nothing pending handed off.
	handedOff map[string]handOffNote
	notes     uint64    // the stamp of the last note
	sweepAt   int       // the size of handedOff that starts a sweep at once
	sweptAt   time.Time // when the last sweep began
	sweeping  atomic.Bool

	// The position of the last events done, for recordPositions.
	toRecord   atomic.Uint64
	recordWake chan struct{}
}

// handOffNote is an aggregate known to have been handed off.
type handOffNote struct {
	// xid is the transaction whose hand-off notice named it (0 when known
	// otherwise): the notice can arrive before that transaction is
	// visible, and its rows are looked up only once it is.
	xid uint32
	// stamp orders the notes: a sweep forgets only aggregates noted
	// before its lookup began.
	stamp uint64
}

// minSweep is the fewest handed-off aggregates a sweep is started for:
// at once when their number doubled since the last sweep, else every
// sweepEvery status intervals.
const (
	minSweep   = 1024
	sweepEvery = 10
)

// item is one event read from the slot.
type item struct {
	ev   core.Event
	txn  *txn
	row  bool  // from a row of the table (ev.Seq is its seq), not a message
	size int64 // payload and header bytes
	bad  error // cannot be relayed: held in the table
	wait bool  // inserted to wait (retry_at set): the table path's
	// deliverAt, when in the future, is when a scheduled event is due;
	// until then it is the table path's too.
	deliverAt time.Time
	// retryAt, once set, is when the table path retries an event handed
	// over after transient failures; it is not held.
	retryAt time.Time
	raw     []byte
	// maybeSent: a row read from before the session's horizon, which
	// the relay that read the slot before may have published.
	maybeSent bool
}

func (s *stream) run(ctx context.Context) (err error) {
	o := s.r.opts
	s.freed = make(chan struct{}, 1)
	// Sweeps of the handed-off aggregates and the recording of positions
	// run beside the reader and end with the session.
	asideCtx, asideCancel := context.WithCancel(context.Background())
	var aside sync.WaitGroup
	defer func() { asideCancel(); aside.Wait() }()
	s.recordWake = make(chan struct{}, 1)
	aside.Add(1)
	go func() {
		defer aside.Done()
		s.recordPositions(asideCtx)
	}()
	engine, err := core.New(s, s.r.pub, o.Options)
	if err != nil {
		return fmt.Errorf("start engine: %w", err)
	}
	s.engine = engine
	// The marker outlives the engine: a stopping engine still records what
	// it published.
	s.marks = newMarker(s.writeMarks)
	mctx, mcancel := context.WithCancel(context.Background())
	marking := make(chan struct{})
	go func() {
		defer close(marking)
		s.marks.run(mctx)
	}()
	stopMarker := func() { mcancel(); <-marking }
	if err := engine.Start(context.Background()); err != nil {
		stopMarker()
		return fmt.Errorf("start engine: %w", err)
	}
	stopped := false
	defer func() {
		if !stopped {
			// The session failed: what is in flight is dropped with it and
			// read again by the next one; what the broker took is still
			// recorded.
			cut, cancel := context.WithCancel(context.Background())
			cancel()
			_ = engine.Stop(cut)
		}
		stopMarker()
		s.r.inFlight.Add(-s.events.Load())
	}()
	drain := func() error {
		stopped = true
		return s.drain()
	}

	confirmAfter := min(o.StatusInterval, confirmEvery)
	var recv deadline
	defer recv.stop()
	lastRecv := time.Now()
	nextStatus, nextConfirm := time.Now(), time.Now()
	for {
		if ctx.Err() != nil {
			return drain()
		}
		select {
		case <-s.stopping:
			return fmt.Errorf("end the stream so the server can shut down: %w", s.stopCause)
		default:
		}
		now := time.Now()
		switch {
		case !now.Before(nextStatus):
			// The publication can change under a running relay: checked
			// with each status, so it is noticed within one.
			qctx, qcancel := context.WithTimeout(ctx, o.StatusInterval)
			err := s.r.checkPublication(qctx)
			qcancel()
			if err != nil {
				if ctx.Err() != nil {
					return drain()
				}
				if errors.Is(err, ErrNotPublished) || errors.Is(err, ErrPublicationFiltered) {
					return err
				}
				if serverStopping(err) {
					// Whatever the engine is doing (a broker outage, a
					// hand-off), a server shutting down waits for this
					// stream: ended here, within a status interval.
					return fmt.Errorf("end the stream so the server can shut down: %w", err)
				}
				s.r.log.Warn("log relay: check publication failed", "error", err)
			}
			if err := s.sendStatus(true); err != nil {
				return err
			}
			if s.sweepDue() {
				aside.Add(1)
				go func() {
					defer aside.Done()
					s.sweepHandedOff(asideCtx)
				}()
			}
			nextStatus, nextConfirm = now.Add(o.StatusInterval), now.Add(confirmAfter)
		case !now.Before(nextConfirm):
			if pos, _ := s.tracker.position(); pos > s.confirmed {
				if err := s.sendStatus(false); err != nil {
					return err
				}
			}
			nextConfirm = now.Add(confirmAfter)
		}
		// A position moves only while events are in flight (finish marks
		// the tracker before the count drops, so the count is read
		// first): an idle reader sleeps until the next status, not
		// every confirmEvery, and whatever it reads wakes it.
		wake := nextStatus
		if nextConfirm.Before(wake) && (s.events.Load() > 0 || s.unconfirmed()) {
			wake = nextConfirm
		}
		if s.full() {
			// Back-pressure: read nothing until an event is done; keep
			// confirming so the server keeps the connection.
			t := time.NewTimer(time.Until(wake))
			select {
			case <-s.freed:
			case <-t.C:
			case <-s.stopping:
			case <-ctx.Done():
			}
			t.Stop()
			// lastRecv stays: reading resumes with what the server
			// sent meanwhile (the replies to these statuses at least),
			// so a live connection answers at once and a dead one is
			// noticed at the first receive.
			continue
		}
		// One deadline per wake time, not per message: at a steady rate
		// a context and its timer for each of a transaction's messages
		// were a tenth of the relay's CPU.
		msg, err := s.conn.ReceiveMessage(recv.until(ctx, wake))
		if err != nil {
			if ctx.Err() != nil {
				// Stopped while waiting for the server: the connection
				// is still good (only the wait was cut short).
				return drain()
			}
			if pgconn.Timeout(err) {
				if since := time.Since(lastRecv); since > o.ReceiveTimeout {
					return fmt.Errorf("no message from the server for %s (limit %s): connection presumed dead", since.Round(time.Millisecond), o.ReceiveTimeout)
				}
				continue
			}
			return fmt.Errorf("receive from slot %s: %w", o.Slot.Name, err)
		}
		lastRecv = time.Now()
		switch msg := msg.(type) {
		case *pgproto3.CopyData:
			if err := s.handle(ctx, msg.Data); err != nil {
				return err
			}
		case *pgproto3.ErrorResponse:
			return fmt.Errorf("slot %s: %w", o.Slot.Name, pgconn.ErrorResponseToPgError(msg))
		case *pgproto3.CopyDone:
			return fmt.Errorf("slot %s: the server ended the stream", o.Slot.Name)
		}
	}
}

// confirmEvery is how soon a position that moved is confirmed, not only at
// each status: what a kill makes the next relay re-send is what was done
// since the last confirmation.
const confirmEvery = 100 * time.Millisecond

// unconfirmed says whether the position moved since it was last confirmed.
func (s *stream) unconfirmed() bool {
	pos, _ := s.tracker.position()
	return pos > s.confirmed
}

// full says whether the in-flight bounds are reached; one event is always
// let in.
func (s *stream) full() bool {
	n := s.events.Load()
	return n > 0 && (n >= int64(s.r.opts.MaxInFlight) || s.bytes.Load() >= int64(s.r.opts.MaxInFlightBytes))
}

// drain stops the engine, which finishes the events read (bounded by
// ShutdownTimeout), confirming meanwhile, confirms a last time and ends
// the stream. It reads nothing from the server, so its statuses keep to
// the clock, however often events finish: the server ends a session that
// sends none for wal_sender_timeout, and a confirmation sent after that is
// lost.
func (s *stream) drain() error {
	o := s.r.opts
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		ctx, cancel := context.WithTimeout(context.Background(), o.ShutdownTimeout)
		defer cancel()
		_ = s.engine.Stop(ctx)
	}()
	tick := time.NewTicker(min(o.StatusInterval, confirmEvery))
	defer tick.Stop()
	for waiting := true; waiting; {
		select {
		case <-stopped:
			waiting = false
		case <-tick.C:
			if pos, _ := s.tracker.position(); pos > s.confirmed || time.Since(s.statusAt) >= o.StatusInterval {
				_ = s.sendStatus(false)
			}
		}
	}
	if n := s.events.Load(); n > 0 {
		s.r.log.Warn("log relay stopped with events in flight; the next relay republishes them", "events", n)
	}
	if err := s.sendStatus(false); err != nil {
		return err
	}
	s.recordLast()
	return s.endCopy()
}

// endCopy ends the stream the way the protocol does (CopyDone, answered by
// the server's CopyDone and the end of the command), bounded by
// ReceiveTimeout. The server handles messages in order, so once it
// answers, the last confirmation is recorded; a connection merely closed
// can lose it, when the server is busy sending or already gave up on us.
func (s *stream) endCopy() error {
	ctx, cancel := context.WithTimeout(context.Background(), s.r.opts.ReceiveTimeout)
	defer cancel()
	s.conn.Frontend().Send(&pgproto3.CopyDone{})
	if err := s.conn.Frontend().Flush(); err != nil {
		return fmt.Errorf("end stream of slot %s: %w", s.r.opts.Slot.Name, err)
	}
	for {
		msg, err := s.conn.ReceiveMessage(ctx)
		if err != nil {
			return fmt.Errorf("end stream of slot %s: the server did not acknowledge position %s: %w", s.r.opts.Slot.Name, s.confirmed, err)
		}
		switch msg := msg.(type) {
		case *pgproto3.ErrorResponse:
			return fmt.Errorf("end stream of slot %s: %w", s.r.opts.Slot.Name, pgconn.ErrorResponseToPgError(msg))
		case *pgproto3.ReadyForQuery:
			return nil
		}
	}
}

func (s *stream) sendStatus(reply bool) error {
	pos, _ := s.tracker.position()
	if pos > s.confirmed || s.events.Load() == 0 {
		s.confirmed = pos
		s.r.advanced.Store(time.Now().UnixNano())
	}
	if e := uint64(s.tracker.lastEvents()); e > s.toRecord.Load() {
		s.toRecord.Store(e)
		select {
		case s.recordWake <- struct{}{}:
		default:
		}
	}
	err := pglogrepl.SendStandbyStatusUpdate(context.Background(), s.conn, pglogrepl.StandbyStatusUpdate{
		WALWritePosition: max(s.received, pos), WALFlushPosition: pos, WALApplyPosition: pos, ReplyRequested: reply,
	})
	if err != nil {
		return fmt.Errorf("confirm position %s: %w", pos, err)
	}
	s.statusAt = time.Now()
	s.r.progress.Store(s.statusAt.UnixNano())
	return nil
}

// handle decodes one message of the replication stream.
func (s *stream) handle(ctx context.Context, data []byte) error {
	if len(data) == 0 {
		return nil
	}
	switch data[0] {
	case pglogrepl.PrimaryKeepaliveMessageByteID:
		k, err := pglogrepl.ParsePrimaryKeepaliveMessage(data[1:])
		if err != nil {
			return fmt.Errorf("parse keepalive: %w", err)
		}
		s.serverClock(k.ServerTime)
		if s.txn == nil {
			s.tracker.idleAt(k.ServerWALEnd)
		}
		if k.ReplyRequested {
			return s.sendStatus(false)
		}
		return nil
	case pglogrepl.XLogDataByteID:
	default:
		return nil
	}
	x, err := pglogrepl.ParseXLogData(data[1:])
	if err != nil {
		return fmt.Errorf("parse WAL data: %w", err)
	}
	s.serverClock(x.ServerTime)
	s.received = max(s.received, x.WALStart+pglogrepl.LSN(len(x.WALData)))
	m, err := pglogrepl.Parse(x.WALData)
	if err != nil {
		return fmt.Errorf("decode pgoutput message: %w", err)
	}
	cfg := s.r.opts.Store
	switch m := m.(type) {
	case *pglogrepl.RelationMessage:
		s.relations[m.RelationID] = m
	case *pglogrepl.BeginMessage:
		s.txn = s.tracker.begin()
		s.txn.xid = m.Xid
		s.commitTime = m.CommitTime
	case *pglogrepl.CommitMessage:
		if s.txn == nil {
			return errors.New("commit without begin in the replication stream")
		}
		s.tracker.commit(s.txn, m.TransactionEndLSN)
		s.txn = nil
	case *pglogrepl.InsertMessage:
		rel := s.relations[m.RelationID]
		if rel == nil {
			return fmt.Errorf("insert into unknown relation %d", m.RelationID)
		}
		if rel.Namespace != cfg.Schema || rel.RelationName != cfg.Table || s.txn == nil {
			return nil
		}
		it, skip := decodeRow(rel, m.Tuple, s.commitTime, cfg)
		if !skip {
			it.maybeSent = x.WALStart <= s.horizon
			s.dispatch(ctx, it)
		}
	case *pglogrepl.LogicalDecodingMessage:
		if m.Prefix == s.r.sql.HandOffPrefix() {
			s.noteHandOff(m)
			return nil
		}
		if m.Prefix != s.r.prefix {
			return nil
		}
		it := decodeMessage(m, s.commitTime, cfg)
		if s.txn == nil {
			// A non-transactional message: a transaction of its own,
			// which ends at the message.
			s.txn = s.tracker.begin()
			it.ev.CreatedAt = time.Now()
			s.dispatch(ctx, it)
			s.tracker.commit(s.txn, m.LSN)
			s.txn = nil
			return nil
		}
		s.dispatch(ctx, it)
	}
	return nil
}

// recordPositions writes the position of the last events done to the
// table (store.LogTable.RecordPosition), each time it moves, one write at
// a time, until ctx ends: the server keeps its slot's confirmed position
// on disk only from time to time, and a relay resuming after a crash of
// the server starts from the later of the two, so it sends again only
// what was not done.
func (s *stream) recordPositions(ctx context.Context) {
	var recorded uint64
	warned := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.recordWake:
		}
		lsn := s.toRecord.Load()
		if lsn <= recorded {
			continue
		}
		err := s.r.sql.RecordPosition(ctx, s.r.pool, s.r.opts.Slot.Name, pglogrepl.LSN(lsn).String())
		switch {
		case ctx.Err() != nil:
			return
		case err != nil && !warned:
			// Tried again at the next confirmation; meanwhile a crash of
			// the server sends more again.
			warned = true
			s.r.log.Warn("log relay: record the confirmed position failed", "error", err)
		case err == nil:
			recorded = lsn
		}
	}
}

// recordLast records the position of the last events done, once the
// stream drained, bounded by a second.
func (s *stream) recordLast() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if lsn := s.toRecord.Load(); lsn > 0 {
		_ = s.r.sql.RecordPosition(ctx, s.r.pool, s.r.opts.Slot.Name, pglogrepl.LSN(lsn).String())
	}
}

// hostClock is this host's clock; tests skew it.
var hostClock = time.Now

// serverClock notes the server's clock at sent, the send time of one of
// its messages.
func (s *stream) serverClock(sent time.Time) {
	if !sent.IsZero() {
		s.clockOffset.Store(int64(sent.Sub(hostClock())))
	}
}

// serverNow is the server's clock now, as last measured.
func (s *stream) serverNow() time.Time {
	return hostClock().Add(time.Duration(s.clockOffset.Load()))
}

// dispatch puts it in the buffer and wakes the engine to claim it.
func (s *stream) dispatch(_ context.Context, it *item) {
	it.txn = s.txn
	s.tracker.add(it.txn)
	s.events.Add(1)
	s.bytes.Add(it.size)
	s.r.inFlight.Add(1)
	s.mu.Lock()
	s.buffered = append(s.buffered, it)
	s.mu.Unlock()
	s.engine.Wake()
}

// finish records it as done: its transaction may now be confirmed.
func (s *stream) finish(it *item) {
	// Done in the tracker before the count drops: a drain that sees
	// nothing in flight then confirms every transaction it read.
	s.tracker.done(it.txn)
	s.events.Add(-1)
	s.bytes.Add(-it.size)
	s.r.inFlight.Add(-1)
	select {
	case s.freed <- struct{}{}:
	default:
	}
}

// isHandedOff says whether agg's events go to the table: it has pending
// handed-off rows. Only aggregates known to have had some are looked up.
func (s *stream) isHandedOff(ctx context.Context, agg string) (bool, error) {
	s.mu.Lock()
	note, known := s.handedOff[agg]
	s.mu.Unlock()
	if !known {
		return false, nil
	}
	if note.xid != 0 {
		if err := s.r.sql.waitVisible(ctx, s.r.pool, s.r.log, note.xid); err != nil {
			return false, err
		}
	}
	pending, err := s.r.sql.AggregateHandedOff(ctx, s.r.pool, agg)
	if err != nil {
		return false, err
	}
	s.mu.Lock()
	switch {
	case s.handedOff[agg] != note:
		// Named by a newer notice meanwhile: looked up again next time.
	case pending:
		s.handedOff[agg] = handOffNote{stamp: note.stamp}
	default:
		delete(s.handedOff, agg)
	}
	s.mu.Unlock()
	return pending, nil
}

// noteHandOff records the aggregates a replay, retry or unpark handed off
// (store.LogTable.HandOffPrefix). Read in commit order, the notice comes
// before every event committed after the command, so none of them can go
// out ahead of the rows it handed off.
func (s *stream) noteHandOff(m *pglogrepl.LogicalDecodingMessage) {
	aggs, err := store.ParseHandOff(m.Content)
	if err != nil {
		s.r.log.Error("log relay: unreadable hand-off notice ignored; the aggregates it names may see new events go out ahead of their handed-off rows",
			"lsn", m.LSN.String(), "error", err)
		return
	}
	var xid uint32
	if m.Transactional && s.txn != nil {
		xid = s.txn.xid
	}
	s.mu.Lock()
	for _, a := range aggs {
		s.noteLocked(a, xid)
	}
	s.mu.Unlock()
}

// noteLocked records agg as handed off, named by transaction xid (0:
// known otherwise); s.mu is held.
func (s *stream) noteLocked(agg string, xid uint32) {
	s.notes++
	s.handedOff[agg] = handOffNote{xid: xid, stamp: s.notes}
}

// sweepDue says whether a sweep of the handed-off aggregates is due and
// none runs; true claims the sweep.
func (s *stream) sweepDue() bool {
	s.mu.Lock()
	n, at := len(s.handedOff), s.sweepAt
	s.mu.Unlock()
	due := n >= at || (n >= minSweep && time.Since(s.sweptAt) >= sweepEvery*s.r.opts.StatusInterval)
	if !due || !s.sweeping.CompareAndSwap(false, true) {
		return false
	}
	s.sweptAt = time.Now()
	return true
}

// sweepHandedOff forgets the handed-off aggregates that have nothing
// pending handed off any more, which a lookup forgets only when a later
// event of the aggregate arrives: one-off keys would keep them for the
// whole session. Only notes made before the lookup began are forgotten:
// a hand-off records its note after its rows commit, so the lookup sees
// the rows of every note it may forget; a notice's transaction must be
// visible first. The next sweep starts at twice the size left.
func (s *stream) sweepHandedOff(ctx context.Context) {
	defer s.sweeping.Store(false)
	s.mu.Lock()
	before := s.notes
	var xids []int64
	for _, n := range s.handedOff {
		if n.xid != 0 {
			xids = append(xids, int64(n.xid))
		}
	}
	s.mu.Unlock()
	visible, err := s.r.sql.visible(ctx, s.r.pool, xids)
	var aggs []string
	if err == nil {
		aggs, err = s.r.sql.HandedOffAggregates(ctx, s.r.pool)
	}
	if err != nil {
		if ctx.Err() == nil {
			s.r.log.Warn("log relay: sweep of handed-off aggregates failed; tried again at the next status", "error", err)
		}
		return
	}
	pending := make(map[string]bool, len(aggs))
	for _, a := range aggs {
		pending[a] = true
	}
	s.mu.Lock()
	for agg, n := range s.handedOff {
		if n.stamp <= before && !pending[agg] && (n.xid == 0 || visible[n.xid]) {
			delete(s.handedOff, agg)
		}
	}
	s.sweepAt = max(minSweep, 2*len(s.handedOff))
	s.mu.Unlock()
}

// deadline is a context with a deadline, made anew only when the
// deadline changes.
type deadline struct {
	ctx    context.Context
	cancel context.CancelFunc
	at     time.Time
}

// until returns a context of parent that ends at at.
func (d *deadline) until(parent context.Context, at time.Time) context.Context {
	if d.ctx == nil || !at.Equal(d.at) {
		d.stop()
		d.ctx, d.cancel = context.WithDeadline(parent, at)
		d.at = at
	}
	return d.ctx
}

func (d *deadline) stop() {
	if d.cancel != nil {
		d.cancel()
	}
}
