package table

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store"
)

// Source is the PostgreSQL outbox. It is safe for concurrent use by many
// relays in many processes.
type Source struct {
	pool *pgxpool.Pool
	cfg  store.Config
	n    store.Names
	log  *slog.Logger

	claimAll, claimUnordered string // claimAll: ordered, every partition
	markDone, markFailed     string
	from                     scanFrom
	sleeper                  sleeper
	share                    share
	handOff                  bool // log mode's table path: takes no table-mode lock (see Hold)
	settle                   settler
}

// scanFrom is where unordered claims start their scan of pending seqs
// while a backlog drains. Marking an event dispatched leaves its entry in
// the pending index until VACUUM, and the relay's other open claims hold
// locked rows there, so a scan from the lowest seq walks every entry
// dispatched since the last VACUUM and every event in flight, and a claim
// slows down with them. While claims come back full, each one starts just
// past the last one's last candidate; every scanFromFor, and after any
// claim that was not full, the scan starts from the bottom again. An
// event that becomes claimable below the start (a producer transaction
// that committed late, an event released by a relay that stopped, a retry
// come due) waits at most that long. Only unordered claims use it: an
// ordered claim must see an aggregate's earliest pending event.
type scanFrom struct {
	mu    sync.Mutex
	id    int64
	since time.Time
}

// scanFromFor bounds how long claims start above the bottom.
const scanFromFor = 250 * time.Millisecond

// get returns the seq to start from; 0 scans from the bottom.
func (f *scanFrom) get() int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.id == 0 || time.Since(f.since) >= scanFromFor {
		return 0
	}
	return f.id
}

// claimed records a claim that started at from, whether its candidates
// filled the batch, and its last candidate's seq.
func (f *scanFrom) claimed(from int64, full bool, last int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	switch {
	case !full:
		f.id = 0
	case from == 0:
		f.id, f.since = last+1, time.Now()
	default:
		f.id = last + 1
	}
}

var (
	_ core.Source        = (*Source)(nil)
	_ core.Notifier      = (*Source)(nil)
	_ core.Pinger        = (*Source)(nil)
	_ core.BacklogReader = (*Source)(nil)
	_ core.Holder        = (*Source)(nil)
)

// New returns a Source over pool. The schema must have been migrated.
// log may be nil.
func New(pool *pgxpool.Pool, cfg store.Config, log *slog.Logger) (*Source, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	n := cfg.Names()
	unordered := `
WITH cand AS MATERIALIZED (
    SELECT ` + claimCols + ` FROM ` + n.Outbox + `
    WHERE ` + claimPending + ` AND seq >= $4
    ORDER BY seq
    LIMIT $1
    FOR UPDATE SKIP LOCKED
), w AS (` + claimRunning + `)
SELECT ` + claimResult("") + `, true
FROM cand c JOIN w ON w.seq = c.seq
ORDER BY c.seq`
	s := &Source{
		pool: pool, cfg: cfg, n: n, log: log, settle: newSettler(cfg),
		claimUnordered: unordered,
		markDone:       `UPDATE ` + n.Outbox + ` SET dispatched_at = now(), retry_at = NULL WHERE seq = ANY($1)`,
		markFailed: `UPDATE ` + n.Outbox + ` AS o
SET attempts = o.attempts + 1, last_error = f.reason, retry_at = COALESCE(f.retry_at, 'infinity'), failed_at = now()
FROM unnest($1::bigint[], $2::text[], $3::timestamptz[]) AS f(seq, reason, retry_at)
WHERE o.seq = f.seq`,
	}
	s.claimAll = s.orderedClaim(nil)
	return s, nil
}

// NewHandOff returns the table source of log mode's table path for the
// outbox cfg names: over its handoff view (store.Config.HandOff), it
// claims only the rows the log relay handed off. It is part of log mode,
// so it takes no table-mode lock (see Hold): the log relay holds the
// log-mode lock.
func NewHandOff(pool *pgxpool.Pool, cfg store.Config, log *slog.Logger) (*Source, error) {
	hc, err := cfg.HandOff()
	if err != nil {
		return nil, err
	}
	s, err := New(pool, hc, log)
	if err != nil {
		return nil, err
	}
	s.handOff = true
	base, err := cfg.WithDefaults()
	if err != nil {
		return nil, err
	}
	s.settle = newSettler(base)
	return s, nil
}

// Config returns the source's configuration with defaults filled in.
func (s *Source) Config() store.Config { return s.cfg }

// Pool returns the connection pool the source uses.
func (s *Source) Pool() *pgxpool.Pool { return s.pool }

// Ping implements core.Pinger.
func (s *Source) Ping(ctx context.Context) error {
	if err := s.pool.Ping(ctx); err != nil {
		return fmt.Errorf("ping database: %w", err)
	}
	return nil
}
