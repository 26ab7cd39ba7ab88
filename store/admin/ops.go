package admin

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/outboxhq/outbox/store"
)

// aggregateCols are the two columns that say where a pending event (the
// outbox row aliased o, in table t) stands in its aggregate, as the
// ordered claim sees it. An event that is not due yet (held, retrying, or
// scheduled: retry_at ahead) keeps back every later event of its
// aggregate; the events before it are due and go out first.
//
// The first column counts the later pending events that wait behind o: all
// of them when o is not due, else those before the next event that is not
// due (the ones after it wait for that one). The second is the event o
// waits for: the earliest earlier event that is not due, or, when there is
// none and o is due, the earliest earlier pending event (ordinary order);
// NULL when o waits for nothing but its own time. Both walk the
// (aggregate_id, seq) index of pending rows.
func aggregateCols(t string) string {
	notDue := `o.retry_at IS NOT NULL AND o.retry_at > now()`
	return `CASE WHEN o.dispatched_at IS NULL AND o.parked_at IS NULL THEN (
           SELECT count(*) FROM ` + t + ` l
           WHERE l.aggregate_id = o.aggregate_id AND l.seq > o.seq
             AND l.dispatched_at IS NULL AND l.parked_at IS NULL
             AND (` + notDue + ` OR l.seq < coalesce((
                 SELECT min(h.seq) FROM ` + t + ` h
                 WHERE h.aggregate_id = o.aggregate_id AND h.seq > o.seq
                   AND h.dispatched_at IS NULL AND h.parked_at IS NULL AND h.retry_at > now()), ` + maxSeq + `))) ELSE 0 END,
       CASE WHEN o.dispatched_at IS NULL AND o.parked_at IS NULL THEN coalesce((
           SELECT min(e.seq) FROM ` + t + ` e
           WHERE e.aggregate_id = o.aggregate_id AND e.seq < o.seq
             AND e.dispatched_at IS NULL AND e.parked_at IS NULL AND e.retry_at > now()),
           CASE WHEN NOT (` + notDue + `) THEN (
           SELECT min(e.seq) FROM ` + t + ` e
           WHERE e.aggregate_id = o.aggregate_id AND e.seq < o.seq
             AND e.dispatched_at IS NULL AND e.parked_at IS NULL) END) END`
}

// handOff is the assignment every command that makes a row pending again
// (replay, retry, unpark) adds. In log mode the log relay reads inserts
// only, so an updated row reaches a broker through the table path, which
// claims the rows handed off to it (migration 8); there the ordered claim
// puts it before the later events of its aggregate. In table mode the
// column means nothing. Such a command runs its UPDATE through
// handingOff, so that the log relay learns of it in commit order.
const handOff = `handoff_at = COALESCE(handoff_at, now())`

// handingOff is HandingOff on the store's outbox.
func (s *Admin) handingOff(update string) string { return store.HandingOff(s.n, update) }

// maxSeq is above every seq.
const maxSeq = `9223372036854775807`

// Operations over the whole outbox: the queries behind `outbox status`,
// `outbox replay` and `outbox cleanup`, and the gauges of the metrics
// poller.

// StatusOptions say what Status measures.
type StatusOptions struct {
	// StuckAfter is the age at which a pending event counts as stuck;
	// default store.DefaultStuckAge.
	StuckAfter time.Duration
	// RelayApplication, when set, lists the database sessions whose
	// application_name it is (the relays) in Status.Replicas.
	RelayApplication string
}

// Status is a snapshot of the outbox: its backlog, read in one
// statement, and the relays' sessions.
type Status struct {
	store.Counts
	Replicas []Replica // only with StatusOptions.RelayApplication
}

// Replica is what the database shows of the relays connected from one
// client address.
type Replica struct {
	Client      string // the relay's application_name suffix (host:pid), else its address
	Connections int
	InClaim     int       // sessions inside a transaction: claims being published
	OldestClaim time.Time // start of the oldest open transaction; zero if none
	// LastQuery is when the relay last sent a statement (its claims, every
	// poll interval when idle): how recently it was seen working.
	LastQuery time.Time
}

// Status measures the outbox (see store.Count).
func (s *Admin) Status(ctx context.Context, opts StatusOptions) (Status, error) {
	c, err := store.Count(ctx, s.pool, s.n, opts.StuckAfter)
	if err != nil {
		return Status{}, err
	}
	st := Status{Counts: c}
	if opts.RelayApplication != "" {
		reps, err := s.replicas(ctx, opts.RelayApplication)
		if err != nil {
			return Status{}, err
		}
		st.Replicas = reps
	}
	return st, nil
}

func (s *Admin) replicas(ctx context.Context, app string) ([]Replica, error) {
	rows, err := s.pool.Query(ctx, `
SELECT COALESCE(NULLIF(substr(application_name, length($1) + 2), ''), host(client_addr), 'local'), count(*),
       count(*) FILTER (WHERE xact_start IS NOT NULL), min(xact_start), max(query_start)
FROM pg_stat_activity
WHERE datname = current_database() AND (application_name = $1 OR starts_with(application_name, $1 || ' '))
GROUP BY 1 ORDER BY 1`, app)
	if err != nil {
		return nil, fmt.Errorf("list relay sessions: %w", err)
	}
	defer rows.Close()
	var out []Replica
	for rows.Next() {
		var (
			r            Replica
			oldest, last *time.Time
		)
		if err := rows.Scan(&r.Client, &r.Connections, &r.InClaim, &oldest, &last); err != nil {
			return nil, fmt.Errorf("list relay sessions: scan: %w", err)
		}
		if oldest != nil {
			r.OldestClaim = *oldest
		}
		if last != nil {
			r.LastQuery = *last
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list relay sessions: %w", err)
	}
	return out, nil
}

// ReplayOptions tune Replay.
type ReplayOptions struct {
	BatchSize int  // events per transaction; default 1000
	DryRun    bool // count what would be replayed, change nothing
	// Progress, when set, is called after each batch with the running total.
	Progress func(replayed int64)
}

// Replay makes dispatched events matching sel pending again, so the relay
// publishes them once more with the same seq, event_id and payload:
// consumers that already processed them drop them as duplicates, and a
// consumer that lost their effects gets them back. Pending and parked events
// are left alone. It works in batches of one short transaction each, in id
// order, and returns how many events it replayed (or would, with DryRun).
// Cancelling ctx stops it between batches; what it replayed stays replayed.
func (s *Admin) Replay(ctx context.Context, sel Selector, opts ReplayOptions) (int64, error) {
	if opts.BatchSize < 0 {
		return 0, invalid("replay events: BatchSize %d is negative", opts.BatchSize)
	}
	if opts.BatchSize == 0 {
		opts.BatchSize = 1000
	}
	cond, args, err := sel.where("", 3)
	if err != nil {
		return 0, fmt.Errorf("replay events: %w", err)
	}
	t := s.n.Outbox
	match := `SELECT seq FROM ` + t + `
    WHERE seq > $1 AND dispatched_at IS NOT NULL AND ` + cond + `
    ORDER BY seq LIMIT $2`
	var sql string
	if opts.DryRun {
		sql = `SELECT count(*), COALESCE(max(seq), 0), 0 FROM (` + match + `) m`
	} else {
		// Row locks in id order, as claims take them; attempts and errors
		// start afresh so the replay is not held back by an old failure.
		// replays counts it: a new delivery, which a publisher that
		// remembers its sends must not take for the first (core.Sent).
		// handoff_at: see handOff.
		sql = s.handingOff(`UPDATE ` + t + ` o SET dispatched_at = NULL, retry_at = NULL, attempts = 0, last_error = NULL, failed_at = NULL,
        replays = o.replays + 1,
        ` + handOff + `
    FROM (` + match + ` FOR UPDATE) m WHERE o.seq = m.seq RETURNING o.aggregate_id, o.seq`)
	}
	var total, after int64
	for {
		if err := ctx.Err(); err != nil {
			return total, fmt.Errorf("replay events (%s): %w", sel, err)
		}
		var n, last, noticed int64
		if err := s.pool.QueryRow(ctx, sql, append([]any{after, opts.BatchSize}, args...)...).Scan(&n, &last, &noticed); err != nil {
			return total, fmt.Errorf("replay events (%s): %w", sel, err)
		}
		total += n
		if n > 0 && opts.Progress != nil {
			opts.Progress(total)
		}
		if n < int64(opts.BatchSize) {
			break
		}
		after = last
	}
	if total > 0 && !opts.DryRun {
		// Wake the relays now rather than at their next poll.
		if _, err := s.pool.Exec(ctx, "SELECT pg_notify($1, '')", s.n.Channel); err != nil {
			s.log.Warn("replay: notify relays", "error", err)
		}
		s.log.Info("events replayed", "selector", sel.String(), "count", total)
	}
	return total, nil
}

// Default retention windows, as CleanupOptions fills them in.
const (
	DefaultDispatchedRetention = 7 * 24 * time.Hour
	DefaultProcessedRetention  = 14 * 24 * time.Hour
	defaultCleanupBatch        = 5000
)

// ErrCleanupBusy is returned by Cleanup when another cleaner of the same
// outbox, in this process or another, holds the cleanup lock.
var ErrCleanupBusy = errors.New("another cleanup of this outbox is running")

// CleanupOptions tune Cleanup. The zero value is valid.
type CleanupOptions struct {
	// Dispatched keeps dispatched events this long after their dispatch;
	// default DefaultDispatchedRetention.
	Dispatched time.Duration
	// Processed keeps consumer dedupe records this long; default
	// DefaultProcessedRetention. It must exceed the longest time in which
	// an event can be delivered again (replays, broker redelivery).
	Processed time.Duration
	BatchSize int           // rows per delete statement; default 5000
	Pause     time.Duration // wait between batches, to spread the I/O; default none
	DryRun    bool          // count what would go, delete nothing
	// Progress, when set, is called after each batch.
	Progress func(CleanupProgress)
}

// CleanupProgress reports a running cleanup.
type CleanupProgress struct {
	Table   string // "outbox" or "processed"
	Deleted int64  // rows deleted from Table so far
}

// CleanupResult says what a Cleanup deleted, or would delete with DryRun.
type CleanupResult struct {
	Outbox, Processed int64
	// Cutoffs: rows older than these went. They are fixed when the run
	// starts, so a long run does not chase the clock.
	OutboxCutoff, ProcessedCutoff time.Time
	Batches                       int
	Elapsed                       time.Duration
	DryRun                        bool
}

// WithDefaults returns o with unset fields at their defaults, or an error
// naming the field out of range.
func (o CleanupOptions) WithDefaults() (CleanupOptions, error) {
	switch {
	case o.Dispatched < 0:
		return o, invalid("cleanup options: Dispatched %v is negative", o.Dispatched)
	case o.Processed < 0:
		return o, invalid("cleanup options: Processed %v is negative", o.Processed)
	case o.BatchSize < 0:
		return o, invalid("cleanup options: BatchSize %d is negative", o.BatchSize)
	case o.Pause < 0:
		return o, invalid("cleanup options: Pause %v is negative", o.Pause)
	}
	if o.Dispatched == 0 {
		o.Dispatched = DefaultDispatchedRetention
	}
	if o.Processed == 0 {
		o.Processed = DefaultProcessedRetention
	}
	if o.BatchSize == 0 {
		o.BatchSize = defaultCleanupBatch
	}
	return o, nil
}

// Cleanup deletes dispatched events older than opts.Dispatched and dedupe
// records older than opts.Processed. Pending and parked events are never
// deleted, whatever their age. Each batch is its own short transaction,
// apart from any claim, so relays keep claiming while it runs. One cleaner
// per outbox runs at a time: Cleanup takes a session advisory lock and
// returns ErrCleanupBusy when another holds it. Cancelling ctx stops it
// between batches.
func (s *Admin) Cleanup(ctx context.Context, opts CleanupOptions) (CleanupResult, error) {
	opts, err := opts.WithDefaults()
	if err != nil {
		return CleanupResult{}, fmt.Errorf("clean up outbox: %w", err)
	}
	start := time.Now()
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return CleanupResult{}, fmt.Errorf("clean up outbox: acquire connection: %w", err)
	}
	defer conn.Release()
	// A session lock, not a transaction one: the batches commit one by
	// one. It goes with the connection if the process dies.
	key := "outbox cleanup " + s.cfg.Schema + "." + s.cfg.Table
	var locked bool
	if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock(hashtextextended($1, 0))", key).Scan(&locked); err != nil {
		return CleanupResult{}, fmt.Errorf("clean up outbox: take cleanup lock: %w", err)
	}
	if !locked {
		return CleanupResult{}, fmt.Errorf("clean up outbox: %w", ErrCleanupBusy)
	}
	defer func() {
		if _, err := conn.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock(hashtextextended($1, 0))", key); err != nil {
			// The connection may keep the lock: close it rather than
			// return it to the pool still locked.
			_ = conn.Conn().Close(context.WithoutCancel(ctx))
		}
	}()

	res := CleanupResult{DryRun: opts.DryRun}
	if err := conn.QueryRow(ctx, "SELECT now() - make_interval(secs => $1), now() - make_interval(secs => $2)",
		opts.Dispatched.Seconds(), opts.Processed.Seconds()).Scan(&res.OutboxCutoff, &res.ProcessedCutoff); err != nil {
		return res, fmt.Errorf("clean up outbox: read clock: %w", err)
	}
	tables := []struct {
		name, count, del string
		cutoff           time.Time
		n                *int64
	}{
		{
			name: "outbox", cutoff: res.OutboxCutoff, n: &res.Outbox,
			count: `SELECT count(*) FROM ` + s.n.Outbox + ` WHERE dispatched_at < $1 AND parked_at IS NULL`,
			// SKIP LOCKED: a row someone holds (a replay) is left for
			// the next run rather than waited for.
			del: `DELETE FROM ` + s.n.Outbox + ` WHERE seq IN (
    SELECT seq FROM ` + s.n.Outbox + ` WHERE dispatched_at < $1 AND parked_at IS NULL
    ORDER BY dispatched_at LIMIT $2 FOR UPDATE SKIP LOCKED)`,
		},
		{
			name: "processed", cutoff: res.ProcessedCutoff, n: &res.Processed,
			count: `SELECT count(*) FROM ` + s.n.Processed + ` WHERE processed_at < $1`,
			del: `DELETE FROM ` + s.n.Processed + ` WHERE (consumer, event_id) IN (
    SELECT consumer, event_id FROM ` + s.n.Processed + ` WHERE processed_at < $1
    ORDER BY processed_at LIMIT $2 FOR UPDATE SKIP LOCKED)`,
		},
	}
	for _, tb := range tables {
		if opts.DryRun {
			if err := conn.QueryRow(ctx, tb.count, tb.cutoff).Scan(tb.n); err != nil {
				return res, fmt.Errorf("clean up %s: count: %w", tb.name, err)
			}
			continue
		}
		for {
			tag, err := conn.Exec(ctx, tb.del, tb.cutoff, opts.BatchSize)
			if err != nil {
				return res, fmt.Errorf("clean up %s: delete batch: %w", tb.name, err)
			}
			res.Batches++
			*tb.n += tag.RowsAffected()
			if opts.Progress != nil {
				opts.Progress(CleanupProgress{Table: tb.name, Deleted: *tb.n})
			}
			if tag.RowsAffected() < int64(opts.BatchSize) {
				break
			}
			if !sleepCtx(ctx, opts.Pause) {
				return res, fmt.Errorf("clean up %s: %w", tb.name, ctx.Err())
			}
		}
	}
	res.Elapsed = time.Since(start)
	if !opts.DryRun {
		s.log.Info("outbox cleaned up", "outbox_deleted", res.Outbox, "processed_deleted", res.Processed,
			"outbox_cutoff", res.OutboxCutoff, "processed_cutoff", res.ProcessedCutoff,
			"batches", res.Batches, "elapsed", res.Elapsed)
	}
	return res, nil
}

// sleepCtx waits d or until ctx is done; false means ctx is done.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// RunRetention runs Cleanup every interval, the first time one minute
// after start (or sooner with a shorter interval), until ctx is done.
// Every replica may run it: the cleanup lock lets one clean at a time, and
// the others skip their turn. Failures are logged and tried again at the
// next interval.
func (s *Admin) RunRetention(ctx context.Context, opts CleanupOptions, interval time.Duration) {
	log := s.log.With("task", "retention")
	if interval <= 0 {
		log.Error("retention not started: interval must be positive", "interval", interval)
		return
	}
	t := time.NewTimer(min(interval, time.Minute))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		res, err := s.Cleanup(ctx, opts)
		switch {
		case errors.Is(err, ErrCleanupBusy):
			log.Debug("retention skipped: another replica is cleaning up")
		case err != nil && ctx.Err() == nil:
			log.Error("retention failed", "error", err, "outbox_deleted", res.Outbox, "processed_deleted", res.Processed)
		}
		t.Reset(interval)
	}
}
