package table_test

import (
	"context"
	"testing"
	"time"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// With wake-ups off (PgBouncer in transaction pooling mode, where LISTEN
// does not work) the relay opens no listener and still publishes every
// committed event by polling.
func TestDisabledWakeupsPollWithoutListening(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	// A channel of its own: relays of other tests listen on the default one.
	cfg.NotifyChannel = cfg.Schema + "_polling"
	in := newInstance(t, pool, cfg)
	pub := &recordingPublisher{got: make(chan string, 16)}
	relay, err := core.New(in.s, pub, core.Options{PollInterval: 100 * time.Millisecond, DisableWakeups: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := relay.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	defer relay.Stop(context.Background())
	if took := writeAndAwait(t, in, pub, 5*time.Second); took > 2*time.Second {
		t.Errorf("polling every 100ms took %v to publish", took)
	}
	if pids := listenerPIDs(t, pool, in.s.Config().NotifyChannel); len(pids) > 0 {
		t.Fatalf("wake-ups are off but sessions %v LISTEN", pids)
	}
}
