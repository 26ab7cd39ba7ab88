package store

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/core"
)

// Listen implements core.Notifier: it holds one connection outside the
// pool, LISTENs on the notify channel and calls wake for each notification.
// After a dropped connection it reconnects with backoff and wakes once, so
// a commit made while it was away is not left waiting for the poll.
func (s *Store) Listen(ctx context.Context, wake func()) error {
	backoff := core.Backoff{Min: 100 * time.Millisecond, Max: 10 * time.Second}
	for attempt := 0; ; attempt++ {
		err := s.listenOnce(ctx, wake, func() { attempt = 0 })
		if ctx.Err() != nil {
			return nil
		}
		wait := backoff.Delay(attempt)
		s.log.Warn("wake-up listener lost its connection; reconnecting", "error", err, "retry_in", wait)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
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
	var args []byte
	err = conn.QueryRow(ctx, `SELECT tgargs FROM pg_trigger WHERE tgrelid = $1::regclass AND tgname = $2`,
		s.n.Outbox, s.cfg.Table+"_notify").Scan(&args)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		s.log.Warn("the outbox table has no notify trigger; producers that do not notify wait for the poll", "table", s.cfg.Table)
	case err != nil:
		return fmt.Errorf("look up notify trigger: %w", err)
	default:
		if ch, _, _ := bytes.Cut(args, []byte{0}); string(ch) != s.cfg.NotifyChannel {
			s.log.Warn("the table's trigger notifies another channel than the one configured; listening on both",
				"configured", s.cfg.NotifyChannel, "trigger", string(ch))
			channels = append(channels, string(ch))
		}
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
