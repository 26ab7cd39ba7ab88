package logrelay

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/outboxhq/outbox/core"
)

// The claims that finish while a mark is written are marked together in
// the next write, not one write each: at a trickle a stream's claims hold
// an event or two, and each write is a transaction the server commits and
// its walsender decodes.
func TestMarkerGroupsClaimsFinishedDuringAWrite(t *testing.T) {
	var mu sync.Mutex
	var writes [][]int64
	first := make(chan struct{})
	release := make(chan struct{})
	m := newMarker(func(_ context.Context, rows []*item) error {
		mu.Lock()
		seqs := make([]int64, len(rows))
		for i, it := range rows {
			seqs[i] = it.ev.Seq
		}
		writes = append(writes, seqs)
		n := len(writes)
		mu.Unlock()
		if n == 1 {
			close(first)
			<-release
		}
		return nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	running := make(chan struct{})
	go func() { defer close(running); m.run(ctx) }()
	defer func() { cancel(); <-running }()

	row := func(seq int64) []*item { return []*item{{ev: core.Event{Seq: seq}, row: true}} }
	errs := make(chan error, 11)
	go func() { errs <- m.mark(ctx, row(1)) }()
	<-first
	const claims = 10
	for i := range claims {
		go func() { errs <- m.mark(ctx, row(int64(2+i))) }()
	}
	eventually(t, func() bool { m.mu.Lock(); defer m.mu.Unlock(); return len(m.waiters) == claims })
	close(release)
	for range claims + 1 {
		if err := <-errs; err != nil {
			t.Fatalf("mark: %v", err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(writes) != 2 || len(writes[0]) != 1 || len(writes[1]) != claims {
		t.Fatalf("writes %v: want the first claim alone, then the %d claims that finished during it in one write", writes, claims)
	}
}

// A stream that ends answers the claims still waiting, and any that come
// later, with errMarkerStopped: their events are not confirmed, and the
// next session reads them again.
func TestMarkerStoppedAnswersItsWaiters(t *testing.T) {
	started := make(chan struct{})
	var once sync.Once
	m := newMarker(func(ctx context.Context, _ []*item) error {
		once.Do(func() { close(started) })
		<-ctx.Done() // a database that does not answer: retried until the stream ends
		return ctx.Err()
	})
	ctx, cancel := context.WithCancel(context.Background())
	running := make(chan struct{})
	go func() { defer close(running); m.run(ctx) }()

	rows := []*item{{ev: core.Event{Seq: 1}, row: true}}
	errs := make(chan error, 2)
	go func() { errs <- m.mark(context.Background(), rows) }()
	<-started
	go func() { errs <- m.mark(context.Background(), rows) }() // queued behind the stuck write
	eventually(t, func() bool { m.mu.Lock(); defer m.mu.Unlock(); return len(m.waiters) == 1 })
	cancel()
	<-running
	for range 2 {
		select {
		case err := <-errs:
			if !errors.Is(err, context.Canceled) && !errors.Is(err, errMarkerStopped) {
				t.Fatalf("mark after the stream ended: %v, want the stream's end", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("a claim still waits for a marker that stopped")
		}
	}
	if err := m.mark(context.Background(), rows); !errors.Is(err, errMarkerStopped) {
		t.Fatalf("mark on a stopped marker: %v, want errMarkerStopped", err)
	}
}

// eventually polls cond for up to five seconds.
func eventually(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 5s")
		}
		time.Sleep(time.Millisecond)
	}
}
