package core_test

import (
	"context"
	"testing"
	"time"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/memsource"
)

func readyErrs(r *core.Relay) map[string]error {
	got := map[string]error{}
	for _, c := range r.Ready(context.Background()) {
		got[c.Name] = c.Err
	}
	return got
}

func TestReadyChecksPublisherAndProgress(t *testing.T) {
	pub := &pingPub{}
	pub.up.Store(true)
	r, err := core.New(memsource.New(), pub, core.Options{PollInterval: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if got := readyErrs(r); got["progress"] == nil {
		t.Errorf("ready before Start: %v", got)
	}
	if err := r.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	defer r.Stop(context.Background())
	waitFor(t, "a cycle", func() bool { return !r.LastProgress().IsZero() })
	got := readyErrs(r)
	if len(got) != 2 || got["progress"] != nil || got["publisher"] != nil {
		t.Errorf("checks with everything up = %v, want progress and publisher ok", got)
	}
	pub.up.Store(false)
	if got := readyErrs(r); got["publisher"] == nil {
		t.Errorf("checks with the broker down = %v, want the publisher failing", got)
	}
}

// blockedStore returns no claim until released, as a database that
// stopped answering.
type blockedStore struct{ released chan struct{} }

func (s blockedStore) Claim(ctx context.Context, _ core.ClaimOptions) (core.Claim, error) {
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-s.released:
		return nil, context.Canceled
	}
}

func TestReadyFailsWithoutProgress(t *testing.T) {
	pub := &pingPub{}
	pub.up.Store(true)
	st := blockedStore{released: make(chan struct{})}
	r := startRelay(t, st, pub, core.Options{StaleAfter: 50 * time.Millisecond})
	t.Cleanup(func() { close(st.released) })
	if got := readyErrs(r); got["progress"] != nil {
		t.Errorf("not ready within the grace after Start: %v", got)
	}
	time.Sleep(100 * time.Millisecond)
	if got := readyErrs(r); got["progress"] == nil {
		t.Errorf("ready although no cycle completed for 100ms (StaleAfter 50ms): %v", got)
	}
}

func TestStaleAfterDefault(t *testing.T) {
	o, err := core.Options{PublishTimeout: time.Minute, PollInterval: time.Second}.WithDefaults()
	if err != nil || o.StaleAfter != 2*time.Minute+3*time.Second {
		t.Errorf("StaleAfter = %v, %v; want 2m3s", o.StaleAfter, err)
	}
	if _, err := (core.Options{StaleAfter: -1}).WithDefaults(); err == nil {
		t.Error("a negative StaleAfter was accepted")
	}
}
