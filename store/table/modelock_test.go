package table_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/table"
)

// A library user's table-mode relay holds the table-mode lock itself: it
// refuses to start while a log relay holds the outbox (here its lock,
// which log relays of every release take by the same key), publishing
// nothing, and starts once the log relay is gone. Only the binary took
// the lock before: a core.New(table.New(...)) relay published every row
// a log relay published too. The source of log mode's own table path
// (NewHandOff) takes no lock and starts beside it.
func TestTableRelayRefusesBesideALogRelay(t *testing.T) {
	ctx := context.Background()
	pool, cfg := pgtest.Schema(t)
	cfg, err := cfg.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	logRelay, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer logRelay.Release() // a no-op once closed below
	if _, err := logRelay.Exec(ctx, "SELECT pg_advisory_lock_shared(hashtextextended($1, 0))", store.ModeLock(cfg, "log")); err != nil {
		t.Fatal(err)
	}
	w, err := outbox.NewWriter(outbox.WriterOptions{Store: cfg})
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Write(ctx, pool, outbox.Message{AggregateID: "a", Type: "a.b", Payload: map[string]int{"n": 1}}); err != nil {
		t.Fatal(err)
	}

	src, err := table.New(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	pub := &recordingPublisher{got: make(chan string, 10)}
	relay, err := core.New(src, pub, core.Options{PollInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var runErr error
	ended := make(chan struct{})
	go func() { runErr = relay.Run(rctx); close(ended) }()
	defer func() { cancel(); <-ended }()
	select {
	case <-ended:
		if !errors.Is(runErr, store.ErrMixedModes) {
			t.Fatalf("table-mode relay beside a log relay: Run = %v, want ErrMixedModes", runErr)
		}
	case id := <-pub.got:
		t.Fatalf("the table-mode relay published event %s beside a log relay", id)
	case <-time.After(15 * time.Second):
		t.Fatal("the table-mode relay runs beside a log relay")
	}

	handOff, err := table.NewHandOff(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	hctx, hcancel := context.WithCancel(ctx)
	held := make(chan struct{})
	hdone := make(chan error, 1)
	go func() { hdone <- handOff.Hold(hctx, func() { close(held) }) }()
	select {
	case <-held:
	case err := <-hdone:
		t.Fatalf("the hand-off source's Hold beside a log relay: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("the hand-off source's Hold did not report held")
	}
	hcancel()
	if err := <-hdone; err != nil {
		t.Fatalf("the hand-off source's Hold ended with %v", err)
	}

	// Closed, the connection's session ends and frees the lock a moment
	// later on the server.
	_ = logRelay.Hijack().Close(ctx)
	waitFor(t, "the log-mode lock to be free", func() bool {
		conn, err := pool.Acquire(ctx)
		if err != nil {
			return false
		}
		defer conn.Release()
		return store.OtherModeFree(ctx, conn.Conn().PgConn(), cfg, "log") == nil
	})
	relay, err = core.New(src, pub, core.Options{PollInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := relay.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer relay.Stop(context.Background())
	select {
	case <-pub.got:
	case <-time.After(15 * time.Second):
		t.Fatal("the table-mode relay did not publish once the log relay was gone")
	}
}

// Table-mode relays starting together all start: each one's check for a
// log relay (store.OtherModeFree) reads the server's locks, and never
// mistakes another relay's check for a log relay. A check that tried the
// log-mode lock took it for a moment, and refused the relays that looked
// meanwhile.
func TestModeChecksDoNotCollide(t *testing.T) {
	ctx := context.Background()
	pool, cfg := pgtest.Schema(t)
	cfg, err := cfg.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	const checkers, checks = 4, 200
	errs := make(chan error, checkers)
	for range checkers {
		go func() {
			conn, err := pool.Acquire(ctx)
			if err != nil {
				errs <- err
				return
			}
			defer conn.Release()
			for range checks {
				if err := store.OtherModeFree(ctx, conn.Conn().PgConn(), cfg, "log"); err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	for range checkers {
		if err := <-errs; err != nil {
			t.Fatalf("concurrent checks with no log relay: %v", err)
		}
	}
}
