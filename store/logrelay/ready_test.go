package logrelay_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store/logrelay"
)

func checkErr(checks []core.Check, name string) error {
	for _, c := range checks {
		if c.Name == name {
			return c.Err
		}
	}
	return errors.New("no check named " + name)
}

// Readiness follows the log path: a reader and a standby are ready; a
// reader whose broker takes nothing is not once staleAfter has passed, and
// is again when it heals; a relay whose replication session fails is not
// until it streams again.
func TestReady(t *testing.T) {
	const stale = 500 * time.Millisecond
	e := newEnv(t)
	e.createSlot()
	cut, proxy := proxiedPool(t)

	down := &recorder{}
	a := startRelay(t, cut, down, e.opts())
	waitFor(t, 10*time.Second, "relay A to hold the slot", a.r.Holding)
	b := e.start(&recorder{}, e.opts())
	time.Sleep(300 * time.Millisecond)
	for name, r := range map[string]*running{"reader": a, "standby": b} {
		for _, c := range r.r.Ready(stale) {
			if c.Err != nil {
				t.Errorf("%s: check %s: %v, want ready", name, c.Name, c.Err)
			}
		}
	}

	down.mu.Lock()
	down.fail = func(*core.Event) error { return errors.New("broker unreachable") }
	down.mu.Unlock()
	e.write(false, uuid.NewString(), 0, 3)
	waitFor(t, 10*time.Second, "the reader's progress check to fail", func() bool {
		return checkErr(a.r.Ready(stale), "log_progress") != nil
	})
	t.Logf("broker down: %v", checkErr(a.r.Ready(stale), "log_progress"))
	down.mu.Lock()
	down.fail = nil
	down.mu.Unlock()
	waitFor(t, 10*time.Second, "the reader's progress check to pass again", func() bool {
		return checkErr(a.r.Ready(stale), "log_progress") == nil
	})

	// A's connection to PostgreSQL is cut: B takes the slot over and is
	// ready; A's sessions fail, and it says so.
	proxy.Cut()
	waitFor(t, 20*time.Second, "relay B to take the slot", b.r.Holding)
	waitFor(t, 20*time.Second, "relay A's session check to fail", func() bool {
		return checkErr(a.r.Ready(stale), "log") != nil
	})
	t.Logf("cut: %v", checkErr(a.r.Ready(stale), "log"))
	if err := checkErr(b.r.Ready(stale), "log"); err != nil {
		t.Errorf("B reading the slot: %v", err)
	}
}

// Readiness describes the present: a relay that creates its own slot
// (after a session failed for the want of it) is ready once it streams,
// though its session never returns to clear the failure.
func TestReadyAfterCreatingItsSlot(t *testing.T) {
	e := newEnv(t)
	o := e.opts() // creates its slot: the default
	rec := &recorder{}
	a := e.start(rec, o)
	waitFor(t, 20*time.Second, "the relay to create its slot and read it", a.r.Holding)
	e.write(false, uuid.NewString(), 0, 1)
	waitFor(t, 20*time.Second, "the event to be published", func() bool { return len(rec.events()) > 0 })
	for _, c := range a.r.Ready(time.Minute) {
		if c.Err != nil {
			t.Errorf("check %s: %v, want ready while reading the slot it created", c.Name, c.Err)
		}
	}
}

// With ManualSlot a missing slot is an operator's to create: Run fails at
// once, naming the command, and creates nothing.
func TestManualSlotMissingFails(t *testing.T) {
	e := newEnv(t)
	o := e.opts()
	o.ManualSlot = true
	r, err := logrelay.New(e.pool, &recorder{}, o)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	err = r.Run(ctx)
	if !errors.Is(err, logrelay.ErrNoSlot) || !strings.Contains(err.Error(), "outbox slot create") {
		t.Fatalf("Run without the slot = %v, want ErrNoSlot naming `outbox slot create`", err)
	}
	if st := e.status(); st.Exists {
		t.Errorf("slot status %+v: the relay created the slot with ManualSlot", st)
	}
}
