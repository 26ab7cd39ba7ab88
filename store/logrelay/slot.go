package logrelay

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"net"
	"regexp"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/store"
)

// Slot names the replication slot and the publication the log relay of
// one outbox reads. The koanf tags are the keys of the binary's
// "relay.log" section.
type Slot struct {
	// Name is the logical replication slot: lower-case letters, digits
	// and underscores, at most 63 bytes. Slot names are shared by every
	// database of a server, so the default, filled in by Resolve, is
	// "outbox_" then the database, schema and table, with other
	// characters as underscores, cut and ended with a hash of the three
	// when longer than 63 bytes or changed by the replacement. A slot with
	// the default of earlier versions (no database) that exists in this
	// database is kept.
	Name string `koanf:"slot"`
	// Publication is the publication on the outbox table the slot's
	// pgoutput reads inserts from. Defaults to the slot's name.
	Publication string `koanf:"publication"`
}

var slotName = regexp.MustCompile(`^[a-z0-9_]{1,63}$`)

// WithDefaults checks the names that are set. An empty Name stays empty:
// its default depends on the database, which Resolve reads.
func (s Slot) WithDefaults(cfg store.Config) (Slot, error) {
	if _, err := cfg.WithDefaults(); err != nil {
		return s, err
	}
	if s.Name != "" && !slotName.MatchString(s.Name) {
		return s, fmt.Errorf("slot %q: want 1 to 63 lower-case letters, digits or underscores", s.Name)
	}
	if s.Publication == "" {
		s.Publication = s.Name
	}
	if len(s.Publication) > 63 || strings.ContainsRune(s.Publication, 0) {
		return s, fmt.Errorf("publication %q: want at most 63 bytes and no NUL", s.Publication)
	}
	return s, nil
}

// Resolve returns s with its defaults filled in for the database pool
// connects to. An empty Name becomes the default of this version unless
// only a slot with the default of earlier versions, which left the
// database out, exists in this database: that one is kept, so an upgrade
// neither strands a slot nor loses its position.
func (s Slot) Resolve(ctx context.Context, pool *pgxpool.Pool, cfg store.Config) (Slot, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return s, err
	}
	if s, err = s.WithDefaults(cfg); err != nil || s.Name != "" {
		return s, err
	}
	var db string
	var legacy bool
	old := legacySlotName(cfg)
	err = pool.QueryRow(ctx, `SELECT current_database(),
       EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND database = current_database())`, old).Scan(&db, &legacy)
	if err != nil {
		return s, fmt.Errorf("resolve slot name: %w", err)
	}
	name := defaultSlotName(db, cfg)
	if legacy {
		var taken bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)`, name).Scan(&taken); err != nil {
			return s, fmt.Errorf("resolve slot name: %w", err)
		}
		if !taken {
			name = old
		}
	}
	s.Name = name
	if s.Publication == "" {
		s.Publication = name
	}
	return s, nil
}

// defaultSlotName is "outbox_<database>_<schema>_<table>" as a slot name.
func defaultSlotName(db string, cfg store.Config) string {
	full := "outbox_" + db + "_" + cfg.Schema + "_" + cfg.Table
	b := slotChars(full)
	if len(b) <= 63 && string(b) == full {
		return full
	}
	// Cut or changed: a hash of the names tells apart databases whose
	// names differ only past the cut or in replaced characters.
	h := fnv.New32a()
	h.Write([]byte(db + "\x00" + cfg.Schema + "\x00" + cfg.Table))
	sum := fmt.Sprintf("_%08x", h.Sum32())
	return string(b[:min(len(b), 63-len(sum))]) + sum
}

// legacySlotName is the default slot name of earlier versions.
func legacySlotName(cfg store.Config) string {
	b := slotChars("outbox_" + cfg.Schema + "_" + cfg.Table)
	return string(b[:min(len(b), 63)])
}

func slotChars(s string) []byte {
	b := []byte(strings.ToLower(s))
	for i, c := range b {
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') {
			b[i] = '_'
		}
	}
	return b
}

// ErrSlotBusy is returned (wrapped) when another session reads the slot:
// only one relay holds a slot at a time.
var ErrSlotBusy = errors.New("replication slot is in use by another relay")

// ErrNoSlot is returned (wrapped) when the slot does not exist.
var ErrNoSlot = errors.New("replication slot does not exist")

// ErrSlotOfOtherDatabase is returned (wrapped) when a slot of the name
// exists but decodes another database: slot names are shared by every
// database of a server.
var ErrSlotOfOtherDatabase = errors.New("replication slot belongs to another database")

func otherDatabase(slot, db string) error {
	return fmt.Errorf("%w: slot %s decodes database %q, not this one; set relay.log.slot to a name of its own (the default includes the database)",
		ErrSlotOfOtherDatabase, slot, db)
}

// ErrSlotLost is returned (wrapped) by Run when the server invalidated the
// slot (wal_status lost: it fell behind max_slot_wal_keep_size and the
// WAL it needed is gone). Retrying cannot fix it, and events committed
// after its confirmed position may never be relayed.
var ErrSlotLost = errors.New("replication slot is invalidated")

// lostError says what an invalidated slot lost and how to recover.
func lostError(st SlotStatus) error {
	why := ""
	if st.InvalidationReason != "" {
		why = " (" + st.InvalidationReason + ")"
	}
	return fmt.Errorf("%w: slot %s was invalidated by the server%s and can no longer be read; "+
		"log-only events committed after its confirmed position %s are lost with the WAL it needed: "+
		"drop it (`outbox slot drop`) and create it again (`outbox slot create`), which hands the table's pending rows to the table path",
		ErrSlotLost, st.Slot, why, st.ConfirmedFlush)
}

// ErrNotPublished is returned (wrapped) by Run when the slot's publication
// does not publish the outbox table's inserts (dropped, the table removed
// from it, or inserts not published): the stream then carries none of its
// rows, and the slot's position would move past them.
var ErrNotPublished = errors.New("publication does not publish the outbox table's inserts")

// ErrPublicationFiltered is returned (wrapped) by Run when the slot's
// publication has a row filter or a column list on the outbox table
// (PostgreSQL 15+): the stream would skip rows, or carry rows the relay
// cannot read, while the slot's position moved past them.
var ErrPublicationFiltered = errors.New("publication filters the outbox table's rows or columns")

// Check verifies what the log relay needs from the server and the role
// before it starts: wal_level logical, and the REPLICATION attribute. The
// error says what to change.
func Check(ctx context.Context, pool *pgxpool.Pool) error {
	var level, role string
	var repl bool
	err := pool.QueryRow(ctx, `SELECT current_setting('wal_level'), current_user,
       (SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user)`).Scan(&level, &role, &repl)
	if err != nil {
		return fmt.Errorf("check server for the log relay: %w", err)
	}
	if err := checkWALLevel(level); err != nil {
		return err
	}
	if !repl {
		return fmt.Errorf("role %q lacks the REPLICATION attribute the log relay needs to read a replication slot: run ALTER ROLE %s REPLICATION (or use relay.mode table)",
			role, pgx.Identifier{role}.Sanitize())
	}
	return nil
}

func checkWALLevel(level string) error {
	if level != "logical" {
		return fmt.Errorf("server has wal_level=%s; the log relay needs wal_level=logical: set it in postgresql.conf (or ALTER SYSTEM SET wal_level = logical) and restart PostgreSQL, or use relay.mode table", level)
	}
	return nil
}

// replicationConn opens a logical replication connection with the
// settings of pool; params are added to its startup parameters. A
// positive deadTimeout is how long a dead peer may go unnoticed by the
// socket: TCP keepalives probe an idle connection, and TCP_USER_TIMEOUT
// ends one whose sent data (the relay's status updates) stays
// unacknowledged, so a relay back-pressured by its broker, which reads
// nothing, still finds out that the server or the network is gone.
func replicationConn(ctx context.Context, pool *pgxpool.Pool, params map[string]string, deadTimeout time.Duration) (*pgconn.PgConn, error) {
	cc := pool.Config().ConnConfig.Copy()
	pc := cc.Config.Copy()
	if pc.RuntimeParams == nil {
		pc.RuntimeParams = map[string]string{}
	}
	pc.RuntimeParams["replication"] = "database"
	for k, v := range params {
		pc.RuntimeParams[k] = v
	}
	conn, err := pgconn.ConnectConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("open replication connection: %w", err)
	}
	if deadTimeout > 0 {
		if err := setDeadTimeout(conn.Conn(), deadTimeout); err != nil {
			_ = conn.Close(context.WithoutCancel(ctx))
			return nil, fmt.Errorf("open replication connection: set TCP timeouts: %w", err)
		}
	}
	return conn, nil
}

// setDeadTimeout sets keepalives and TCP_USER_TIMEOUT (see
// replicationConn) on c's TCP socket; other sockets (Unix) are left.
func setDeadTimeout(c net.Conn, d time.Duration) error {
	for {
		u, ok := c.(interface{ NetConn() net.Conn }) // TLS
		if !ok {
			break
		}
		c = u.NetConn()
	}
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return nil
	}
	probe := max(d/5, time.Second)
	if err := tc.SetKeepAliveConfig(net.KeepAliveConfig{Enable: true, Idle: probe, Interval: probe, Count: 4}); err != nil {
		return err
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return err
	}
	return setUserTimeout(rc, d)
}

func lockKey(s Slot) string { return "outbox slot " + s.Name }

// Created says what CreateSlot did.
type Created struct {
	Slot, Publication bool // created now (false: it existed)
	// HandedOff counts pending rows committed before the slot existed,
	// which its stream will never carry: they were handed to the table
	// path, which publishes them in order.
	HandedOff int64
}

// CreateSlot creates the publication on the outbox table (inserts only)
// and the slot, each unless it exists. Pending rows the slot's stream
// cannot carry, those committed before its consistent point (read in the
// snapshot the slot exports), are handed to the table path, so switching
// an outbox from table mode to log mode loses nothing. Creating the
// publication needs ownership of the table.
func CreateSlot(ctx context.Context, pool *pgxpool.Pool, cfg store.Config, s Slot) (Created, error) {
	var c Created
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return c, err
	}
	if s, err = s.Resolve(ctx, pool, cfg); err != nil {
		return c, err
	}
	if err := Check(ctx, pool); err != nil {
		return c, err
	}
	lt, err := newLogTable(cfg)
	if err != nil {
		return c, err
	}
	table := pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize()
	if c.Publication, err = createPublication(ctx, pool, s, table); err != nil {
		return c, err
	}
	st, err := Inspect(ctx, pool, cfg, s)
	if err != nil {
		return c, err
	}
	if st.Exists {
		return c, keepSlot(ctx, pool, lt, s, st)
	}
	unlock, err := lockSlotCreation(ctx, pool, s)
	if err != nil {
		return c, err
	}
	defer unlock()
	made, err := createViaTemporary(ctx, pool, cfg, lt, s)
	made.Publication = c.Publication
	if err != nil {
		return made, err
	}
	if made.Slot && st.FailoverCapable {
		// A relay that took the slot meanwhile makes it one itself.
		if err := makeFailover(ctx, pool, s.Name); err != nil && !errors.Is(err, ErrSlotBusy) {
			return made, err
		}
	}
	// Only now may log-only events be written: the permanent slot reads
	// every transaction that commits after this.
	return made, lt.recordSlot(ctx, pool, s.Name, s.Publication)
}

// keepSlot checks the slot st that exists already, makes it a failover
// slot where it can, and records it.
func keepSlot(ctx context.Context, pool *pgxpool.Pool, lt *logTable, s Slot, st SlotStatus) error {
	if !st.InThisDatabase {
		return fmt.Errorf("create slot: %w", otherDatabase(s.Name, st.Database))
	}
	if st.Plugin != "pgoutput" {
		return fmt.Errorf("create slot %s: it exists with plugin %s, not pgoutput", s.Name, st.Plugin)
	}
	if st.WALStatus == "lost" {
		return fmt.Errorf("create slot: %w", lostError(st))
	}
	if st.FailoverCapable && !st.Failover && !st.Active {
		// A relay that took the slot meanwhile makes it one itself.
		if err := makeFailover(ctx, pool, s.Name); err != nil && !errors.Is(err, ErrSlotBusy) {
			return err
		}
	}
	// Recorded again: a slot made before the record existed.
	return lt.recordSlot(ctx, pool, s.Name, s.Publication)
}

// lockSlotCreation takes the slot's advisory lock on a pooled connection,
// so that one process at a time creates it; unlock lets it go.
func lockSlotCreation(ctx context.Context, pool *pgxpool.Pool, s Slot) (unlock func(), err error) {
	lock, err := pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("create slot %s: %w", s.Name, err)
	}
	if _, err := lock.Exec(ctx, "SELECT pg_advisory_lock(hashtextextended($1, 0))", lockKey(s)); err != nil {
		lock.Release()
		return nil, fmt.Errorf("create slot %s: take lock: %w", s.Name, err)
	}
	return func() {
		_, _ = lock.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock(hashtextextended($1, 0))", lockKey(s))
		lock.Release()
	}, nil
}

// createViaTemporary makes the slot in two steps so that a crash anywhere
// loses nothing: a temporary slot (it goes with its connection) exports
// the snapshot, the rows it sees pending are handed off, and only then is
// it copied to the permanent slot, from the same position. A crash before
// the copy leaves no slot, so the next attempt starts over; a permanent
// slot made first would strand those rows if the process died before
// handing them over. Slot is false when another relay made the slot
// meanwhile.
func createViaTemporary(ctx context.Context, pool *pgxpool.Pool, cfg store.Config, lt *logTable, s Slot) (Created, error) {
	repl, err := replicationConn(ctx, pool, nil, 0)
	if err != nil {
		return Created{}, fmt.Errorf("create slot %s: %w", s.Name, err)
	}
	defer repl.Close(context.WithoutCancel(ctx))
	// The rows handed off below would be published by table-mode
	// relays too.
	if err := store.OtherModeFree(ctx, repl, cfg, "table"); err != nil {
		return Created{}, fmt.Errorf("create slot %s: %w", s.Name, err)
	}
	// A record of a slot of this name that does not exist (dropped by
	// other means, or copied with the table from another cluster) carries
	// another slot's position: it goes before this slot is made.
	if err := lt.forgetSlot(ctx, pool, s.Name); err != nil {
		return Created{}, fmt.Errorf("create slot %s: %w", s.Name, err)
	}
	tmp := fmt.Sprintf("outbox_creating_%d", repl.PID())
	res, err := pglogrepl.CreateReplicationSlot(ctx, repl, tmp, "pgoutput",
		pglogrepl.CreateReplicationSlotOptions{Temporary: true, Mode: pglogrepl.LogicalReplication, SnapshotAction: "EXPORT_SNAPSHOT"})
	if err != nil {
		return Created{}, fmt.Errorf("create slot %s: %w", s.Name, err)
	}
	handedOff, err := handOffBefore(ctx, pool, lt, res.SnapshotName)
	if err != nil {
		return Created{}, fmt.Errorf("create slot %s: hand off rows committed before it: %w", s.Name, err)
	}
	c := Created{HandedOff: handedOff}
	_, err = pool.Exec(ctx, "SELECT pg_copy_logical_replication_slot($1, $2, false)", tmp, s.Name)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42710" { // duplicate_object: another relay made it
		return c, nil
	}
	if err != nil {
		return c, fmt.Errorf("create slot %s: %w", s.Name, err)
	}
	c.Slot = true
	return c, nil
}

// handOffBefore hands to the table path the pending rows that the
// snapshot, exported by the slot being made, sees: committed before the
// slot's consistent point, the slot's stream will never carry them.
func handOffBefore(ctx context.Context, pool *pgxpool.Pool, lt *logTable, snapshot string) (int64, error) {
	// The exported snapshot lives while the replication connection stays
	// idle: read the rows it sees, then let it go.
	var seqs []int64
	err := pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SET TRANSACTION SNAPSHOT '"+strings.ReplaceAll(snapshot, "'", "''")+"'"); err != nil {
			return fmt.Errorf("import the slot's snapshot: %w", err)
		}
		var err error
		seqs, err = lt.unhanded(ctx, tx)
		return err
	})
	var n int64
	if err == nil && len(seqs) > 0 {
		n, err = lt.handOffUnhanded(ctx, pool, seqs)
	}
	if err == nil && testHookHandedOff != nil {
		err = testHookHandedOff()
	}
	return n, err
}

// testHookHandedOff, when set (by tests), runs after the hand-off and
// before the permanent slot is made: an error stands for a crash there.
var testHookHandedOff func() error

func createPublication(ctx context.Context, pool *pgxpool.Pool, s Slot, table string) (bool, error) {
	var exists bool
	if err := pool.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)", s.Publication).Scan(&exists); err != nil {
		return false, fmt.Errorf("look up publication %s: %w", s.Publication, err)
	}
	if exists {
		return false, nil
	}
	_, err := pool.Exec(ctx, "CREATE PUBLICATION "+pgx.Identifier{s.Publication}.Sanitize()+" FOR TABLE "+table+" WITH (publish = 'insert')")
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42710" {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("create publication %s: %w", s.Publication, err)
	}
	return true, nil
}

// DropSlot drops the slot and the publication, those that exist. A slot
// a relay is reading cannot be dropped: stop the relays first. Dropping
// the slot loses its position: events committed since the last confirmed
// one are not relayed by a slot created later.
func DropSlot(ctx context.Context, pool *pgxpool.Pool, cfg store.Config, s Slot) error {
	s, err := s.Resolve(ctx, pool, cfg)
	if err != nil {
		return err
	}
	var db *string
	var here bool
	err = pool.QueryRow(ctx, "SELECT database, database = current_database() FROM pg_replication_slots WHERE slot_name = $1", s.Name).Scan(&db, &here)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("look up slot %s: %w", s.Name, err)
	}
	if err == nil && !here {
		return fmt.Errorf("drop slot: %w", otherDatabase(s.Name, deref(db)))
	}
	if err == nil {
		if err := dropSlot(ctx, pool, s.Name); err != nil {
			return err
		}
	}
	lt, err := newLogTable(cfg)
	if err != nil {
		return err
	}
	if err := lt.forgetSlot(ctx, pool, s.Name); err != nil {
		return fmt.Errorf("drop slot: %w", err)
	}
	if _, err := pool.Exec(ctx, "DROP PUBLICATION IF EXISTS "+pgx.Identifier{s.Publication}.Sanitize()); err != nil {
		return fmt.Errorf("drop publication %s: %w", s.Publication, err)
	}
	return nil
}

func dropSlot(ctx context.Context, pool *pgxpool.Pool, name string) error {
	_, err := pool.Exec(ctx, "SELECT pg_drop_replication_slot($1)", name)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "55006" {
		return fmt.Errorf("drop slot %s: %w (%s)", name, ErrSlotBusy, pgErr.Message)
	}
	if err != nil {
		return fmt.Errorf("drop slot %s: %w", name, err)
	}
	return nil
}

// SlotStatus is what the server shows of a slot and its publication.
type SlotStatus struct {
	Slot, Publication string
	Exists            bool // the slot exists
	// Database is the database the slot decodes; InThisDatabase says it
	// is the one the pool connects to.
	Database       string
	InThisDatabase bool
	Plugin         string
	Active         bool  // a relay is reading it
	ActivePID      int32 // its walsender's process id
	ConfirmedFlush string
	RestartLSN     string
	// LagBytes is the WAL between the server's current position and the
	// slot's confirmed position: what the relays have not confirmed yet.
	LagBytes int64
	// RetainedBytes is the WAL the server keeps for the slot (from its
	// restart position): the disk an idle or stuck relay costs.
	RetainedBytes int64
	// WALStatus is reserved, extended, unreserved or lost (the slot fell
	// behind max_slot_wal_keep_size and can no longer be read).
	WALStatus string
	// SafeWALBytes is how much more WAL can be written before the slot is
	// lost; -1 when max_slot_wal_keep_size is unlimited.
	SafeWALBytes int64
	// InvalidationReason is why the server invalidated the slot
	// (wal_removed, rows_removed, wal_level_insufficient, idle_timeout),
	// from PostgreSQL 17 on; empty otherwise.
	InvalidationReason string
	// FailoverCapable says the server can synchronize the slot to its
	// standbys (PostgreSQL 17 and later); Failover that the slot is a
	// failover slot, which they do synchronize.
	FailoverCapable, Failover bool
	// PublicationExists and PublicationTables describe the publication.
	PublicationExists bool
	PublicationTables []string
}

// Inspect reads the slot's status. A missing slot is not an error:
// Exists is false.
func Inspect(ctx context.Context, pool *pgxpool.Pool, cfg store.Config, s Slot) (SlotStatus, error) {
	s, err := s.Resolve(ctx, pool, cfg)
	if err != nil {
		return SlotStatus{}, err
	}
	st := SlotStatus{Slot: s.Name, Publication: s.Publication}
	version, err := serverVersion(ctx, pool)
	if err != nil {
		return st, fmt.Errorf("inspect slot %s: %w", s.Name, err)
	}
	st.FailoverCapable = version >= failoverVersion
	var pid *int32
	var confirmed, restart, walStatus, db, reason *string
	var lag, retained, safe *int64
	var failover *bool
	// Columns of later versions are read through to_jsonb, which leaves
	// them NULL where the server has none.
	err = pool.QueryRow(ctx, `
SELECT plugin, active, active_pid, confirmed_flush_lsn::text, restart_lsn::text,
       (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint, (pg_current_wal_lsn() - restart_lsn)::bigint,
       wal_status, safe_wal_size, database, database IS NOT DISTINCT FROM current_database(),
       to_jsonb(s) ->> 'invalidation_reason', (to_jsonb(s) ->> 'failover')::boolean
FROM pg_replication_slots s WHERE slot_name = $1`, s.Name).Scan(&st.Plugin, &st.Active, &pid, &confirmed, &restart, &lag, &retained, &walStatus, &safe,
		&db, &st.InThisDatabase, &reason, &failover)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
	case err != nil:
		return st, fmt.Errorf("inspect slot %s: %w", s.Name, err)
	default:
		st.Exists = true
		st.Database = deref(db)
		st.ActivePID = deref(pid)
		st.ConfirmedFlush, st.RestartLSN, st.WALStatus = deref(confirmed), deref(restart), deref(walStatus)
		st.LagBytes, st.RetainedBytes = deref(lag), deref(retained)
		st.InvalidationReason, st.Failover = deref(reason), deref(failover)
		st.SafeWALBytes = -1
		if safe != nil {
			st.SafeWALBytes = *safe
		}
	}
	// The tables are named one by one by oid: through
	// pg_publication_tables the planner, expecting a thousand of them,
	// hashed the whole of pg_class, which the slot gauges did every ten
	// seconds (tens of milliseconds on a server with many relations).
	err = pool.QueryRow(ctx, `
SELECT true, COALESCE((SELECT array_agg(name ORDER BY 1) FROM pg_get_publication_tables(p.pubname) t,
       LATERAL (SELECT format('%I.%I', n.nspname, c.relname) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                WHERE c.oid = t.relid OFFSET 0) AS r(name)), '{}')
FROM pg_publication p WHERE pubname = $1`, s.Publication).Scan(&st.PublicationExists, &st.PublicationTables)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return st, fmt.Errorf("inspect publication %s: %w", s.Publication, err)
	}
	return st, nil
}

func deref[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}
