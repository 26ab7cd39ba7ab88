package store

import (
	"context"
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
	if _, err := conn.Exec(ctx, "LISTEN "+ident(s.cfg.NotifyChannel)); err != nil {
		return fmt.Errorf("listen %s: %w", s.cfg.NotifyChannel, err)
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
