package outboxcli

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store/migrate"
)

// A relay that starts while PostgreSQL or the broker is down (starting,
// failing over, the migration not yet run) waits for them rather than exit
// and be restarted in a loop. /healthz answers meanwhile and /readyz names
// what the relay waits for.

// startupBackoff paces the attempts of a starting relay: quick at first, as
// a database that is starting comes up in seconds, then every 15s at most.
var startupBackoff = core.Backoff{Min: 500 * time.Millisecond, Max: 15 * time.Second}

// connectTimeout bounds one attempt to reach the database.
const connectTimeout = 15 * time.Second

// startup is what a starting relay waits for, in order, each with why it
// is not reached yet (nil once it is).
type startup struct {
	mu    sync.Mutex
	names []string
	errs  map[string]error
}

func newStartup(names ...string) *startup {
	s := &startup{names: names, errs: map[string]error{}}
	for _, n := range names {
		s.errs[n] = errors.New("not tried yet")
	}
	return s
}

func (s *startup) set(name string, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.errs[name] = err
}

// checks returns one readiness check per service.
func (s *startup) checks() []core.Check {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]core.Check, 0, len(s.names))
	for _, n := range s.names {
		out = append(out, core.Check{Name: n, Err: s.errs[n]})
	}
	return out
}

// waitFor calls try until it succeeds, logging each failed attempt. It
// gives up, with an error of ExitUnavailable, when ctx ends or the next
// attempt would start past deadline (zero: wait forever); a usage error
// (bad configuration) ends it at once, as waiting does not fix it.
func (e *app) waitFor(ctx context.Context, deadline time.Time, s *startup, name string, try func(context.Context) error) error {
	start := time.Now()
	for attempt := 1; ; attempt++ {
		err := try(ctx)
		if err == nil {
			s.set(name, nil)
			if attempt > 1 {
				e.log.Info(name+" reached", "attempts", attempt, "waited", time.Since(start).Round(time.Millisecond))
			}
			return nil
		}
		var x *exitError
		if errors.As(err, &x) && x.code == ExitUsage {
			return err
		}
		s.set(name, fmt.Errorf("waiting since %s, attempt %d: %w", start.UTC().Format(time.RFC3339), attempt, err))
		delay := startupBackoff.Delay(attempt - 1)
		if !deadline.IsZero() && time.Now().Add(delay).After(deadline) {
			if left := time.Until(deadline); left > 0 {
				delay = left // one last attempt at the deadline
			} else {
				return unavailable(fmt.Errorf("%s not reached within relay.startup_timeout %s (%d attempts): %w",
					name, e.cfg.Relay.StartupTimeout, attempt, err))
			}
		}
		e.log.Warn("waiting for the "+name, "attempt", attempt, "retry_in", delay.Round(time.Millisecond), "error", err)
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return unavailable(fmt.Errorf("stopped while waiting for the %s: %w", name, err))
		case <-t.C:
		}
	}
}

// startupDeadline is when a relay starting now gives up.
func (e *app) startupDeadline() time.Time {
	if t := e.cfg.Relay.StartupTimeout; t > 0 {
		return time.Now().Add(t)
	}
	return time.Time{}
}

// reachDatabase connects and checks that the schema is migrated: a
// migration that runs beside the relay's start (a Job, a unit of its own)
// is waited for too.
func (e *app) reachDatabase(pool *pgxpool.Pool) func(context.Context) error {
	return func(ctx context.Context) error {
		cctx, cancel := context.WithTimeout(ctx, connectTimeout)
		defer cancel()
		if err := pool.Ping(cctx); err != nil {
			return fmt.Errorf("connect to database %s: %w", Redact(e.cfg.DatabaseURL), err)
		}
		return migrate.CheckSchema(cctx, pool, e.cfg.StoreConfig())
	}
}
