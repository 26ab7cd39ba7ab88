package logrelay_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store/logrelay"
)

// shutdownBound is how long a fast shutdown of PostgreSQL may take with a
// log relay whose events cannot be recorded: the relay notices the
// shutdown at its next status (StatusInterval, 1s here as by default),
// when its check on an ordinary connection fails, and ends its stream;
// the rest is the server's own work, with room for a loaded machine.
const shutdownBound = 10 * time.Second

// privateEnv is an outbox on a server of the test's own, with its slot
// and a relay, for tests that stop the server.
func privateEnv(t *testing.T) (*env, *pgtest.Server) {
	t.Helper()
	srv := pgtest.Private(t, nil)
	return privateOutbox(t, srv.Pool(t), "outbox_shutdown"), srv
}

// stopFast stops the server with pg_ctl stop -m fast and fails the test
// unless it is down within shutdownBound.
func stopFast(t *testing.T, srv *pgtest.Server) {
	t.Helper()
	start := time.Now()
	if err := srv.Stop("fast", shutdownBound); err != nil {
		t.Fatalf("fast shutdown not done within %s: %v\n%s", shutdownBound, err, srv.Log())
	}
	t.Logf("fast shutdown took %s", time.Since(start).Round(10*time.Millisecond))
}

// A fast shutdown of PostgreSQL completes within shutdownBound while the
// log relay's events cannot be recorded: during a broker outage (events
// in flight, never published) and while an event is being handed to the
// table (here blocked on the hand-off's lock). The server waits for every
// walsender's client to confirm what it was sent; the relay, unable to
// confirm its in-flight events, used to keep it waiting indefinitely.
func TestFastShutdownCompletesWhileEventsAreStuck(t *testing.T) {
	opts := func(e *env) logrelay.Options {
		o := e.opts()
		o.StatusInterval = time.Second
		o.ReceiveTimeout = 5 * time.Second
		o.WALSenderTimeout = -1 // the server's 60s: no rescue by its timeout
		o.HandOffAfter = -1
		return o
	}
	t.Run("broker_outage", func(t *testing.T) {
		e, srv := privateEnv(t)
		pub := &recorder{fail: func(*core.Event) error { return errors.New("connection refused") }}
		r := e.start(pub, opts(e))
		waitFor(t, 10*time.Second, "the relay to hold the slot", r.r.Holding)
		e.write(true, uuid.NewString(), 0, 3)
		e.write(false, uuid.NewString(), 0, 3)
		waitFor(t, 10*time.Second, "6 events in flight", func() bool { return r.r.InFlight() == 6 })
		stopFast(t, srv)
	})
	t.Run("hand_off", func(t *testing.T) {
		e, srv := privateEnv(t)
		r := e.start(&recorder{}, opts(e))
		waitFor(t, 10*time.Second, "the relay to hold the slot", r.r.Holding)
		ctx := context.Background()
		// Hand-offs take the slot's lock shared: held exclusively here,
		// the hand-off of a scheduled event waits.
		lock, err := pgx.Connect(ctx, srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		defer lock.Close(ctx)
		if _, err := lock.Exec(ctx, "SELECT pg_advisory_lock(hashtextextended($1, 0))", "outbox slot "+e.slot.Name); err != nil {
			t.Fatal(err)
		}
		fn, err := e.cfg.LogWriteFunc()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := e.pool.Exec(ctx, `SELECT `+fn+`(json_build_object('v', 1, 'event_id', gen_random_uuid(), 'aggregate_id', 'a',
    'type', 'order.placed', 'deliver_at', now() + interval '1 hour', 'payload', '{}'::json)::text)`); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 10*time.Second, "the hand-off to wait for the lock", func() bool {
			var n int
			err := e.pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted`).Scan(&n)
			return err == nil && n == 1
		})
		stopFast(t, srv)
	})
}
