package store

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outboxhq/outbox/core"
)

// Listen implements core.Notifier: it holds one connection outside the
// pool, LISTENs on the notify channel and calls wake for each notification.
// After a dropped connection it reconnects with backoff and wakes once, so
// a commit made while it was away is not left waiting for the poll.
func (s *Store) Listen(ctx context.Context, wake func()) error {
	// The relay sleeps (Sleep) only while it listens.
	defer s.closeSleeper(ctx)
	keepSession(ctx, func(connected func()) error { return s.listenOnce(ctx, wake, connected) },
		func(err error, wait time.Duration) {
			s.log.Warn("wake-up listener lost its connection; reconnecting", "error", err, "retry_in", wait)
		})
	return nil
}

// keepSession runs once until ctx is done, and again after each loss,
// backing off from 100ms to 10s; the backoff starts over once a session
// connects. lost hears of each loss and the wait before the next try.
func keepSession(ctx context.Context, once func(connected func()) error, lost func(err error, wait time.Duration)) {
	backoff := core.Backoff{Min: 100 * time.Millisecond, Max: 10 * time.Second}
	for attempt := 0; ; attempt++ {
		err := once(func() { attempt = 0 })
		if ctx.Err() != nil {
			return
		}
		wait := backoff.Delay(attempt)
		lost(err, wait)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

func (s *Store) listenOnce(ctx context.Context, wake, connected func()) error {
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
	for _, ch := range channels {
		if _, err := conn.Exec(ctx, "LISTEN "+ident(ch)); err != nil {
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
func (s *Store) triggerChannel(ctx context.Context, conn *pgx.Conn) (string, error) {
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

// sleeper holds, on a connection of its own, the advisory lock by which a
// relay asks producers to wake it (migration 10): held, producers notify;
// free, a producer takes it shared until its commit.
type sleeper struct {
	mu   sync.Mutex
	conn *pgx.Conn
	key  int64
	held bool
}

var _ core.Sleeper = (*Store)(nil)

// Sleep implements core.Sleeper: it takes the wake-up lock, waiting at
// most limit for the producers that hold it shared (they wrote without
// notifying) to commit. A lock it cannot take in time (another relay
// sleeps, or a producer's transaction stays open) leaves producers
// notifying or not as they were; the relay polls.
func (s *Store) Sleep(ctx context.Context, limit time.Duration) error {
	w := &s.sleeper
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.held {
		return nil
	}
	if w.conn == nil {
		conn, err := pgx.ConnectConfig(ctx, s.pool.Config().ConnConfig.Copy())
		if err != nil {
			return fmt.Errorf("connect sleeper: %w", err)
		}
		// The trigger's key (migrations 10 and 12).
		err = conn.QueryRow(ctx, "SELECT hashtextextended($1, 0)", wakeKey(s.cfg.Schema, s.cfg.Table)).Scan(&w.key)
		if err != nil {
			_ = conn.Close(context.WithoutCancel(ctx))
			return fmt.Errorf("sleeper key: %w", err)
		}
		w.conn = conn
	}
	// lock_timeout, not ctx, bounds the wait: a cancelled query costs the
	// connection.
	_, err := w.conn.Exec(ctx, fmt.Sprintf("SET lock_timeout = %d; SELECT pg_advisory_lock(%d)", max(limit.Milliseconds(), 1), w.key))
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == "55P03": // lock_not_available
		return fmt.Errorf("take wake-up lock: not free within %s", limit)
	case err != nil:
		w.close(ctx)
		return fmt.Errorf("take wake-up lock: %w", err)
	}
	w.held = true
	return nil
}

// Awake implements core.Sleeper: it releases the wake-up lock.
func (s *Store) Awake(ctx context.Context) error {
	w := &s.sleeper
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.held {
		return nil
	}
	w.held = false
	if _, err := w.conn.Exec(ctx, fmt.Sprintf("SELECT pg_advisory_unlock(%d)", w.key)); err != nil {
		w.close(ctx)
		return fmt.Errorf("release wake-up lock: %w", err)
	}
	return nil
}

// closeSleeper closes the sleeper's connection, which frees its lock.
func (s *Store) closeSleeper(ctx context.Context) {
	s.sleeper.mu.Lock()
	defer s.sleeper.mu.Unlock()
	s.sleeper.held = false
	s.sleeper.close(ctx)
}

func (w *sleeper) close(ctx context.Context) {
	if w.conn != nil {
		_ = w.conn.Close(context.WithoutCancel(ctx))
		w.conn = nil
	}
}

// wakeKey is the text whose hash is the advisory lock a sleeping relay
// holds and a writing producer tries shared (the notify trigger's WHEN).
func wakeKey(schema, table string) string { return "outbox-wake:" + schema + "." + table }
