package ordering_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store/admin"
)

// routedBroker resolves topics with brokers.Routing and rejects messages
// over a size limit as a broker does (Kafka's MESSAGE_TOO_LARGE): both are
// permanent failures. Routing and limit can be changed while it runs, as
// an operator fixes the configuration.
type routedBroker struct {
	routing  atomic.Pointer[brokers.Routing]
	maxBytes atomic.Int64

	mu  sync.Mutex
	got []delivered
}

type delivered struct {
	id         int64
	uid, topic string
}

func (b *routedBroker) Publish(_ context.Context, e *core.Event) error {
	topic, err := b.routing.Load().Topic(e)
	if err != nil {
		return err
	}
	if limit := b.maxBytes.Load(); int64(len(e.Payload)) > limit {
		return core.Permanent(fmt.Errorf("broker rejected a message of %d bytes: MESSAGE_TOO_LARGE (limit %d)", len(e.Payload), limit))
	}
	b.mu.Lock()
	b.got = append(b.got, delivered{e.Seq, e.ID, topic})
	b.mu.Unlock()
	return nil
}

func (b *routedBroker) Close() error { return nil }

// order returns the position of each delivered event id.
func (b *routedBroker) order() map[int64]int {
	b.mu.Lock()
	defer b.mu.Unlock()
	m := make(map[int64]int, len(b.got))
	for i, d := range b.got {
		if _, dup := m[d.id]; !dup {
			m[d.id] = i
		}
	}
	return m
}

func (b *routedBroker) uidOf(id int64) string {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, d := range b.got {
		if d.id == id {
			return d.uid
		}
	}
	return ""
}

type failureCounter struct{ permanent, transient atomic.Int64 }

func (c *failureCounter) Claimed(int, time.Duration) {}
func (c *failureCounter) Published(_ *core.Event, _ time.Duration, err error) {
	switch {
	case err == nil:
	case core.IsPermanent(err):
		c.permanent.Add(1)
	default:
		c.transient.Add(1)
	}
}
func (c *failureCounter) Completed(int, int, time.Duration) {}
func (c *failureCounter) Errored(string, error)             {}
func (*failureCounter) Rejected(*core.Event, error)         {}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// An oversized payload and an unroutable type among good events: the good
// ones flow, the bad ones are held with their reason and hold back only
// their own aggregate, visibly; fixing the configuration and retrying
// publishes them, parking lets the aggregate go on, and an unparked event
// goes out with its identity.
func TestPoisonEventsHoldOnlyTheirAggregate(t *testing.T) {
	e := newEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	st, err := admin.New(e.admin, e.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	w, err := outbox.NewWriter(outbox.WriterOptions{Store: e.cfg})
	if err != nil {
		t.Fatal(err)
	}
	// write commits one transaction per aggregate and returns the ids.
	write := func(agg string, msgs ...outbox.Message) []int64 {
		t.Helper()
		for i := range msgs {
			msgs[i].AggregateID = agg
		}
		tx, err := e.admin.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(ctx) }()
		if err := w.Write(ctx, tx, msgs...); err != nil {
			t.Fatal(err)
		}
		var ids []int64
		rows, err := tx.Query(ctx, `SELECT seq FROM `+e.table()+` WHERE aggregate_id = $1 AND dispatched_at IS NULL ORDER BY seq`, agg)
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var id int64
			if err := rows.Scan(&id); err != nil {
				t.Fatal(err)
			}
			ids = append(ids, id)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		return ids[len(ids)-len(msgs):]
	}
	small := map[string]int{"n": 1}
	big := map[string]string{"blob": strings.Repeat("x", 4000)}
	var good []int64
	writeGood := func(n int) {
		for range n {
			good = append(good, write(uuid.NewString(),
				outbox.Message{Type: "order.placed", Payload: small},
				outbox.Message{Type: "order.paid", Payload: small})...)
		}
	}
	writeGood(20)
	bigAgg, oddAgg := uuid.NewString(), uuid.NewString()
	bigIDs := write(bigAgg,
		outbox.Message{Type: "doc.created", Payload: small},
		outbox.Message{Type: "doc.uploaded", Payload: big},
		outbox.Message{Type: "doc.closed", Payload: small})
	oddIDs := write(oddAgg,
		outbox.Message{Type: "audit", Payload: small}, // no dot, no rule: no route
		outbox.Message{Type: "odd.next", Payload: small})
	writeGood(20)

	broker := &routedBroker{}
	broker.routing.Store(&brokers.Routing{})
	broker.maxBytes.Store(1024)
	failures := &failureCounter{}
	logs := &syncBuffer{}
	opts := relayOptions(false)
	opts.Observer = failures
	opts.Logger = slog.New(slog.NewTextHandler(logs, nil))
	for i := range 2 {
		r := &replica{env: e, name: fmt.Sprintf("%s-p%d", e.cfg.Schema, i), pub: broker, opts: opts}
		r.start()
		t.Cleanup(r.stop)
	}

	heldNow := func() map[int64]admin.StuckEvent {
		list, err := st.Stuck(ctx, admin.StuckOptions{})
		if err != nil {
			t.Fatal(err)
		}
		m := map[int64]admin.StuckEvent{}
		for _, s := range list {
			m[s.Seq] = s
		}
		return m
	}
	allOut := func(ids ...int64) bool {
		got := broker.order()
		for _, id := range ids {
			if _, ok := got[id]; !ok {
				return false
			}
		}
		return true
	}
	waitFor(t, 30*time.Second, "good events out and two events held", func() bool {
		return allOut(append(good, bigIDs[0])...) && len(heldNow()) == 2
	})

	held := heldNow()
	tooBig, noRoute := held[bigIDs[1]], held[oddIDs[0]]
	if !tooBig.Held || !strings.Contains(tooBig.LastError, "MESSAGE_TOO_LARGE") || tooBig.HeldBack != 1 || !tooBig.Blocking {
		t.Errorf("oversized event listed as %+v", tooBig)
	}
	if !noRoute.Held || !strings.Contains(noRoute.LastError, brokers.ErrNoRoute.Error()) || noRoute.HeldBack != 1 || noRoute.Type != "audit" {
		t.Errorf("unroutable event listed as %+v", noRoute)
	}
	if allOut(bigIDs[2]) || allOut(oddIDs[1]) {
		t.Fatal("an event published ahead of its aggregate's held event")
	}

	// The relay goes on with new work and does not retry the held events.
	writeGood(10)
	waitFor(t, 30*time.Second, "events written after the poison to go out", func() bool { return allOut(good...) })
	for id, s := range heldNow() {
		if s.Attempts != 1 {
			t.Errorf("held event %d attempted %d times, want once", id, s.Attempts)
		}
	}
	if n := failures.permanent.Load(); n != 2 {
		t.Errorf("observer saw %d permanent failures, want 2", n)
	}
	for _, want := range []string{"MESSAGE_TOO_LARGE", "no topic route", "permanent=true"} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("relay log does not mention %q", want)
		}
	}

	// Fix the routing, retry: the event and the one behind it go out in order.
	broker.routing.Store(&brokers.Routing{Types: map[string]string{"audit": "audit-log"}})
	if n, err := st.Retry(ctx, admin.Selector{Type: "audit"}); err != nil || n != 1 {
		t.Fatalf("Retry = %d, %v", n, err)
	}
	waitFor(t, 30*time.Second, "the retried event and its successor", func() bool { return allOut(oddIDs...) })
	if got := broker.order(); got[oddIDs[0]] > got[oddIDs[1]] {
		t.Fatal("retried event went out after its successor")
	}

	// Park the oversized one: its aggregate proceeds without it.
	uid := tooBig.ID
	if n, err := st.Park(ctx, admin.Selector{Seqs: bigIDs[1:2]}, "payload over the broker limit"); err != nil || n != 1 {
		t.Fatalf("Park = %d, %v", n, err)
	}
	waitFor(t, 30*time.Second, "the event behind the parked one", func() bool { return allOut(bigIDs[2]) })
	if len(heldNow()) != 0 {
		t.Fatalf("Stuck still lists %+v", heldNow())
	}
	list, err := st.Stuck(ctx, admin.StuckOptions{IncludeParked: true})
	if err != nil || len(list) != 1 || list[0].Seq != bigIDs[1] || list[0].ParkedReason != "payload over the broker limit" {
		t.Fatalf("Stuck with parked = %+v, %v", list, err)
	}

	// Raise the broker's limit and unpark: it goes out with its identity.
	broker.maxBytes.Store(1 << 20)
	if n, err := st.Unpark(ctx, admin.Selector{AggregateID: bigAgg}); err != nil || n != 1 {
		t.Fatalf("Unpark = %d, %v", n, err)
	}
	waitFor(t, 30*time.Second, "the unparked event", func() bool { return allOut(bigIDs[1]) })
	if got := broker.uidOf(bigIDs[1]); got != uid {
		t.Fatalf("unparked event went out with uid %s, want %s", got, uid)
	}
	waitFor(t, 10*time.Second, "nothing pending", func() bool { return e.pending(ctx) == 0 })
}
