package logrelay_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store/admin"
)

// binding is a publisher that keeps the sources the relays bind it to
// (core.Binder), as an exactly-once publisher does. The events of
// aggregate slow wait until gate closes.
type binding struct {
	*recorder
	slow    string
	gate    chan struct{}
	stalled atomic.Int32
	mu      sync.Mutex
	srcs    []core.Source
}

func (b *binding) Publish(ctx context.Context, e *core.Event) error {
	if e.AggregateID == b.slow {
		b.stalled.Add(1)
		select {
		case <-b.gate:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return b.recorder.Publish(ctx, e)
}

func (b *binding) Bind(src core.Source) (core.Publisher, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.srcs = append(b.srcs, src)
	return b, nil
}

// settler is the source the publisher was last bound to, as a Settler.
func (b *binding) settler(t *testing.T) core.Settler {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.srcs) == 0 {
		t.Fatal("the publisher was never bound")
	}
	st, ok := b.srcs[len(b.srcs)-1].(core.Settler)
	if !ok {
		t.Fatalf("the log relay's source %T is not a core.Settler", b.srcs[len(b.srcs)-1])
	}
	return st
}

// sentOf names the published events of ids as a publisher would.
func (b *binding) sentOf(t *testing.T, ids []string) []core.Sent {
	t.Helper()
	want := map[string]bool{}
	for _, id := range ids {
		want[id] = true
	}
	var out []core.Sent
	for _, e := range b.events() {
		if want[e.ID] {
			if e.Unit != 0 {
				t.Errorf("event %s has unit %d; the stream has one, 0", e.ID, e.Unit)
			}
			out = append(out, core.Sent{Unit: e.Unit, Seq: e.Seq, ID: e.ID, Replays: e.Replays})
			delete(want, e.ID)
		}
	}
	if len(want) > 0 {
		t.Fatalf("%d events not published", len(want))
	}
	return out
}

// The stream as a Settler: a published row is settled once marked
// dispatched, a pending one is not; a log-only event, and an event the
// relay did not read (here a row's seq under another id), stays unsettled
// while a new session could resume before its transaction's end: here
// while an earlier event's publish hangs, so the position cannot pass
// it, then until it passes.
func TestStreamUnsettled(t *testing.T) {
	e := newEnv(t)
	e.createSlot()
	slow := uuid.NewString()
	pub := &binding{recorder: &recorder{}, slow: slow, gate: make(chan struct{})}
	o := e.opts()
	o.PublishTimeout = time.Minute // the stuck publish lasts until released
	r := e.start(pub, o)
	waitFor(t, 10*time.Second, "the relay to hold the slot", r.r.Holding)
	st := pub.settler(t)
	if name, n := st.Units(); name != e.cfg.Schema+"."+e.cfg.Table+".log" || n != 1 {
		t.Fatalf("Units() = %q, %d; want %q, 1", name, n, e.cfg.Schema+"."+e.cfg.Table+".log")
	}
	ctx := context.Background()

	e.write(false, slow, 0, 1)
	waitFor(t, 10*time.Second, "the stuck event's publish", func() bool { return pub.stalled.Load() > 0 })
	pendingRow := e.write(true, slow, 1, 1)[0] // waits behind it
	// Claimed alone: a claim is recorded once all its events are done,
	// so rows claimed with it would wait for their marks too.
	time.Sleep(500 * time.Millisecond)
	rows := e.write(true, "rows", 0, 5)
	msgs := e.write(false, "msgs", 0, 5)
	waitFor(t, 20*time.Second, "the rows and messages published, the rows marked", func() bool {
		got := pub.distinct()
		for _, id := range append(append([]string{}, rows...), msgs...) {
			if got[id] == 0 {
				return false
			}
		}
		return e.count("dispatched_at IS NOT NULL") == len(rows)
	})
	time.Sleep(300 * time.Millisecond) // any confirmation is sent and recorded
	var rowSeq int64
	table := pgx.Identifier{e.cfg.Schema, e.cfg.Table}.Sanitize()
	if err := e.pool.QueryRow(ctx, "SELECT seq FROM "+table+" WHERE event_id = $1", pendingRow).Scan(&rowSeq); err != nil {
		t.Fatal(err)
	}
	rowSent, msgSent := pub.sentOf(t, rows), pub.sentOf(t, msgs)
	pending := core.Sent{Seq: rowSeq, ID: pendingRow}
	stranger := core.Sent{Seq: rowSeq, ID: uuid.NewString()}
	ask := append(append(append([]core.Sent{}, rowSent...), msgSent...), pending, stranger)
	got, err := st.Unsettled(ctx, ask)
	if err != nil {
		t.Fatal(err)
	}
	want := append(append([]core.Sent{}, msgSent...), pending, stranger)
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("while the position is held back, Unsettled = %v, want the messages, the pending row and the stranger: %v", got, want)
	}

	close(pub.gate)
	waitFor(t, 20*time.Second, "every row marked", func() bool { return e.count("dispatched_at IS NULL") == 0 })
	waitFor(t, 20*time.Second, "the messages and the pending row settled", func() bool {
		got, err := st.Unsettled(ctx, append(append([]core.Sent{}, msgSent...), pending))
		if err != nil {
			t.Fatal(err)
		}
		return len(got) == 0
	})
	// The stranger is bounded by the WAL position when first asked about:
	// it goes once the position passes that, here with the next event.
	last := e.write(false, "last", 0, 1)
	waitFor(t, 20*time.Second, "the stranger settled once an event after it is", func() bool {
		got, err := st.Unsettled(ctx, []core.Sent{stranger})
		if err != nil {
			t.Fatal(err)
		}
		return len(got) == 0 && pub.distinct()[last[0]] > 0
	})

	// A replayed row is a new delivery, for the table path: the send
	// before it is settled, the replay's is not until recorded.
	ad, err := admin.New(e.pool, e.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ad.Replay(ctx, admin.Selector{Seqs: []int64{rowSent[0].Seq}}, admin.ReplayOptions{}); err != nil {
		t.Fatal(err)
	}
	replay := rowSent[0]
	replay.Replays++
	got, err = st.Unsettled(ctx, []core.Sent{rowSent[0], replay})
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(got) != fmt.Sprint([]core.Sent{replay}) {
		t.Fatalf("after a replay Unsettled = %v, want only the replay's send %v", got, replay)
	}
}
