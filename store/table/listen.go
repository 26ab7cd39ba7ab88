package table

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store"
)

// Listen implements core.Notifier: it holds one connection outside the
// pool, LISTENs on the notify channel and calls wake for each notification.
// After a dropped connection it reconnects with backoff and wakes once, so
// a commit made while it was away is not left waiting for the poll.
func (s *Source) Listen(ctx context.Context, wake func()) error {
	// The relay sleeps (Sleep) only while it listens.
	defer s.closeSleeper(ctx)
	// A session ends with an error, unless ctx ended it.
	_ = sessionBackoff.Retry(ctx, func(connected func()) error { return s.listenOnce(ctx, wake, connected) },
		func(err error, wait time.Duration) {
			s.log.Warn("wake-up listener lost its connection; reconnecting", "error", err, "retry_in", wait)
		})
	return nil
}

// sessionBackoff paces the reconnects of the source's own sessions (the
// listener's, the sharing one's): from 100ms to 10s, starting over once a
// session connects.
var sessionBackoff = core.Backoff{Min: 100 * time.Millisecond, Max: 10 * time.Second}

func (s *Source) listenOnce(ctx context.Context, wake, connected func()) error {
	conn, err := pgx.ConnectConfig(ctx, s.pool.Config().ConnConfig.Copy())
	if err != nil {
		return fmt.Errorf("connect listener: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	channels := []string{s.cfg.NotifyChannel}
	// The table's trigger notifies the channel configured when it was
	// migrated; a relay configured with another one listens there too
	// rather than sleeping out its poll interval.
	if ch, err := s.triggerChannel(ctx, conn); err != nil {
		return err
	} else if ch != s.cfg.NotifyChannel {
		s.log.Warn("the table's trigger notifies another channel than the one configured; listening on both",
			"configured", s.cfg.NotifyChannel, "trigger", ch)
		channels = append(channels, ch)
	}
	s.setChannel(channels[len(channels)-1])
	for _, ch := range channels {
		if _, err := conn.Exec(ctx, "LISTEN "+store.Ident(ch)); err != nil {
			return fmt.Errorf("listen %s: %w", ch, err)
		}
	}
	connected()
	wake()
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return fmt.Errorf("wait for notification: %w", err)
		}
		wake()
	}
}

// triggerChannel is the channel the table's notify trigger notifies: the
// configured one, unless the table was migrated with another.
func (s *Source) triggerChannel(ctx context.Context, conn *pgx.Conn) (string, error) {
	var args []byte
	err := conn.QueryRow(ctx, `SELECT tgargs FROM pg_trigger WHERE tgrelid = $1::regclass AND tgname = $2`,
		s.n.Outbox, s.cfg.Table+"_notify").Scan(&args)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		s.log.Warn("the outbox table has no notify trigger; producers that do not notify wait for the poll", "table", s.cfg.Table)
		return s.cfg.NotifyChannel, nil
	case err != nil:
		return "", fmt.Errorf("look up notify trigger: %w", err)
	}
	ch, _, _ := bytes.Cut(args, []byte{0})
	return string(ch), nil
}

// sleeper keeps, on a connection of its own, the wake-up lock by which
// the store's sleeping relays ask producers to notify (migrations 10 and
// 12): while a relay holds the lock, or waits for it, producers cannot
// take it shared and notify; while nobody does, a producer takes it shared
// until its commit and does not notify. A relay about to sleep waits for
// none of them: it takes the lock if it is free, or leaves a request
// waiting in the background behind the producers (and the other relays)
// that hold it. When the request is granted, the producers it waited for
// have committed without notifying, and some of their events may belong
// to partitions of relays other than this one; so the same statement
// notifies, and every sleeping relay claims once more.
type sleeper struct {
	mu       sync.Mutex
	conn     *pgx.Conn
	key      int64
	backend  backendID
	channel  string // where producers notify, once Listen has read it
	sleepers int    // the store's relays asleep
	held     bool   // the lock is held and conn idle
	wait     *lockWait
}

// lockWait is a request for the wake-up lock waiting in the background;
// conn is its own until done is closed.
type lockWait struct {
	stop   atomic.Bool // asked to end: make no new request
	cancel context.CancelFunc
	done   chan struct{}
	err    error // set before done is closed
}

// backendID names the sleeper's server session from another session: its
// process id, valid only on the same server instance.
type backendID struct {
	pid     int32
	started time.Time
}

var _ core.Sleeper = (*Source)(nil)

// Sleep implements core.Sleeper. It returns at once: now when the lock
// was free (nothing to wait for: the relay claims once more), or with a
// request left waiting behind the lock's holders, whose grant notifies.
func (s *Source) Sleep(ctx context.Context) (now bool, err error) {
	w := &s.sleeper
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.wait != nil {
		select {
		case <-w.wait.done:
			w.settle(ctx)
		default:
		}
	}
	if w.held || w.wait != nil {
		w.sleepers++ // another relay of this store sleeps already
		return w.held, nil
	}
	if err := s.connectSleeper(ctx); err != nil {
		return false, err
	}
	if err := w.conn.QueryRow(ctx, fmt.Sprintf("SELECT pg_try_advisory_lock(%d)", w.key)).Scan(&now); err != nil {
		w.close(ctx)
		return false, fmt.Errorf("take wake-up lock: %w", err)
	}
	w.sleepers++
	if now {
		w.held = true
		return true, nil
	}
	channel := w.channel
	if channel == "" {
		channel = s.cfg.NotifyChannel
	}
	wctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	lw := &lockWait{cancel: cancel, done: make(chan struct{})}
	w.wait = lw
	go func(conn *pgx.Conn) {
		defer close(lw.done)
		lw.err = w.await(wctx, conn, lw, channel)
	}(w.conn)
	return false, nil
}

// waitChunk is how long a waiting request waits at a time while producers
// hold the lock shared. Between waits it looks at who holds it: a
// producer that committed meanwhile wrote without notifying, and the
// request notifies for it, so that one producer staying open does not
// hide the others' commits.
const waitChunk = 100 * time.Millisecond

// await waits for the lock on conn until it is granted, or lw is asked to
// stop (errWaitStopped).
func (w *sleeper) await(ctx context.Context, conn *pgx.Conn, lw *lockWait, channel string) error {
	notify := "SELECT pg_notify(" + store.Literal(channel) + ", '')"
	timeout := waitChunk.Milliseconds()
	var holders []string // the producers holding the lock shared at the last look
	for {
		if lw.stop.Load() {
			return errWaitStopped
		}
		// One implicit transaction: the notification goes out only with
		// the lock.
		_, err := conn.Exec(ctx, fmt.Sprintf("SET lock_timeout = %d; SELECT pg_advisory_lock(%d); %s", timeout, w.key, notify))
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "55P03" { // lock_not_available
			return err
		}
		var now []string
		err = conn.QueryRow(ctx, `SELECT coalesce(array_agg(virtualtransaction ORDER BY virtualtransaction), '{}') FROM pg_locks
WHERE locktype = 'advisory' AND objsubid = 1 AND mode = 'ShareLock' AND granted
  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND ((classid::bigint << 32) | objid::bigint) = $1`, w.key).Scan(&now)
		if err != nil {
			return fmt.Errorf("read the wake-up lock's holders: %w", err)
		}
		if len(now) == 0 {
			// The producers are gone, and the grant that followed them
			// notified (or this request's will). Behind relays only:
			// while this request waits, no producer can take the lock
			// shared.
			timeout = 0
			continue
		}
		// Some producers may have committed since the request began (the
		// first look) or since the last look.
		if holders == nil || slices.ContainsFunc(holders, func(h string) bool { return !slices.Contains(now, h) }) {
			if _, err := conn.Exec(ctx, notify); err != nil {
				return err
			}
		}
		holders = now
	}
}

// errWaitStopped is how a waiting request asked to stop ends.
var errWaitStopped = errors.New("wake-up lock's wait stopped")

// Awake implements core.Sleeper: once the store's last sleeping relay
// wakes, it withdraws the waiting request or releases the lock.
func (s *Source) Awake(ctx context.Context) error {
	w := &s.sleeper
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.sleepers == 0 {
		return nil
	}
	if w.sleepers--; w.sleepers > 0 {
		return nil
	}
	if w.wait != nil {
		select {
		case <-w.wait.done:
		default:
			s.cancelWait(ctx)
		}
		if !w.settle(ctx) {
			return nil
		}
		// A cancel that came after the grant leaves the lock held (a
		// session lock outlives its statement's failure).
		w.held = true
	}
	if !w.held {
		return nil
	}
	w.held = false
	if _, err := w.conn.Exec(ctx, "SELECT pg_advisory_unlock_all()"); err != nil {
		w.close(ctx)
		return fmt.Errorf("release wake-up lock: %w", err)
	}
	return nil
}

// cancelWait ends the waiting request. A cancel sent through the pool
// keeps the connection; it is sent again until the wait ends, for one
// that reaches the server before the request does is ignored. One that
// fails, or does not end the wait within cancelWithin, costs the
// connection instead.
func (s *Source) cancelWait(ctx context.Context) {
	w := &s.sleeper
	w.wait.stop.Store(true)
	deadline := time.Now().Add(cancelWithin)
	for again := time.Millisecond; ; again = min(2*again, 100*time.Millisecond) {
		// The pool may reach another server than the sleeper's session (a
		// failover between them), where its process id names another
		// session.
		var sent bool
		// Bounded: a pool whose connections are all taken (claims held
		// open by hanging publishes) must not hold the sleeper up.
		qctx, cancel := context.WithDeadline(ctx, deadline)
		err := s.pool.QueryRow(qctx, "SELECT CASE WHEN pg_postmaster_start_time() = $2 THEN pg_cancel_backend($1) ELSE false END",
			w.backend.pid, w.backend.started).Scan(&sent)
		cancel()
		if err != nil || !sent || time.Now().After(deadline) {
			s.log.Debug("the wake-up lock's wait did not end on cancel; closing its connection", "error", err)
			w.wait.cancel()
			<-w.wait.done
			return
		}
		t := time.NewTimer(again)
		select {
		case <-w.wait.done:
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// cancelWithin bounds the wait for a cancelled lock request to end before
// its connection is closed.
const cancelWithin = 5 * time.Second

// settle records how the finished waiting request ended: granted, the
// lock is held; failed, it may be held or not, and settle reports whether
// the connection is still open. A failure it did not ask for (a lost
// connection) leaves the sleeping relays to their poll, which makes the
// sleep anew.
func (w *sleeper) settle(ctx context.Context) (open bool) {
	lw := w.wait
	w.wait = nil
	lw.cancel()
	if lw.err == nil {
		w.held = true
		return true
	}
	if w.conn.IsClosed() {
		w.close(ctx)
		return false
	}
	return true
}

// connectSleeper opens the sleeper's connection if it has none.
func (s *Source) connectSleeper(ctx context.Context) error {
	w := &s.sleeper
	if w.conn != nil {
		return nil
	}
	cc := s.pool.Config().ConnConfig.Copy()
	// Its one long statement waits for the lock until cancelled.
	cc.RuntimeParams["lock_timeout"] = "0"
	cc.RuntimeParams["statement_timeout"] = "0"
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return fmt.Errorf("connect sleeper: %w", err)
	}
	// The trigger's key (migrations 10 and 12).
	err = conn.QueryRow(ctx, "SELECT hashtextextended($1, 0), pg_backend_pid(), pg_postmaster_start_time()",
		s.n.WakeKey).Scan(&w.key, &w.backend.pid, &w.backend.started)
	if err != nil {
		_ = conn.Close(context.WithoutCancel(ctx))
		return fmt.Errorf("sleeper key: %w", err)
	}
	w.conn = conn
	return nil
}

// setChannel records the channel producers notify, which a relay granted
// the lock after waiting notifies too.
func (s *Source) setChannel(ch string) {
	s.sleeper.mu.Lock()
	defer s.sleeper.mu.Unlock()
	s.sleeper.channel = ch
}

// closeSleeper closes the sleeper's connection, which frees its lock.
func (s *Source) closeSleeper(ctx context.Context) {
	w := &s.sleeper
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.wait != nil {
		w.wait.cancel()
		<-w.wait.done
		w.wait = nil
	}
	w.held = false
	w.sleepers = 0
	w.close(ctx)
}

func (w *sleeper) close(ctx context.Context) {
	if w.conn != nil {
		_ = w.conn.Close(context.WithoutCancel(ctx))
		w.conn = nil
	}
}
