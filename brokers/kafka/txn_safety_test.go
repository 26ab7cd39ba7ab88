package kafka_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/brokertest"
	"github.com/outboxhq/outbox/brokers/kafka"
	"github.com/outboxhq/outbox/core"
)

// drain reads every record of topic visible at level: up to the last
// stable offset (read_committed) or the high watermark. Transaction
// markers come through too, so the read knows when it reached the end.
func drain(t *testing.T, addrs []string, topic string, level kgo.IsolationLevel) []*kgo.Record {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	adm := kadm.NewClient(mustClientAt(t, addrs))
	list := adm.ListEndOffsets
	if level == kgo.ReadCommitted() {
		list = adm.ListCommittedOffsets
	}
	offs, err := list(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	end := map[int32]int64{}
	offs.Each(func(o kadm.ListedOffset) {
		if o.Offset > 0 {
			end[o.Partition] = o.Offset
		}
	})
	cl, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchIsolationLevel(level), kgo.KeepControlRecords())
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	var got []*kgo.Record
	for len(end) > 0 {
		f := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("topic %s: reading to offsets %v timed out", topic, end)
		}
		f.EachRecord(func(r *kgo.Record) {
			if e, ok := end[r.Partition]; ok && r.Offset >= e-1 {
				delete(end, r.Partition)
			}
			if !r.Attrs.IsControl() {
				got = append(got, r)
			}
		})
	}
	return got
}

func mustClientAt(t *testing.T, addrs []string) *kgo.Client {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(addrs...))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	return cl
}

// ids lists the outbox event ids of records, sorted.
func ids(recs []*kgo.Record) []string {
	var out []string
	for _, r := range recs {
		out = append(out, header(r, "event_id"))
	}
	slices.Sort(out)
	return out
}

func header(r *kgo.Record, key string) string {
	for _, h := range r.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

// progressIDs is the event ids a progress record names.
func progressIDs(t *testing.T, r *kgo.Record) []string {
	t.Helper()
	var v struct {
		Events []struct {
			Seq int64  `json:"seq"`
			ID  string `json:"id"`
		} `json:"events"`
	}
	if err := json.Unmarshal(r.Value, &v); err != nil {
		t.Fatalf("progress record %q: %v", r.Value, err)
	}
	var out []string
	for _, e := range v.Events {
		out = append(out, e.ID)
	}
	return out
}

func ev(seq int64, agg string, unit int) *core.Event {
	return &core.Event{Seq: seq, ID: fmt.Sprintf("00000000-0000-4000-8000-%012d", seq), AggregateID: agg, Type: "order.placed",
		Payload: []byte(`{"n":` + strconv.FormatInt(seq, 10) + `}`), Unit: unit, CreatedAt: time.Now()}
}

func newTx(t *testing.T, kf *kfake.Cluster) *kafka.TxPublisher {
	t.Helper()
	p, err := kafka.NewTx(t.Context(), txConfig(kf), &brokers.Routing{}, brokertest.Logger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func bind(t *testing.T, p *kafka.TxPublisher, src core.Source) core.Publisher {
	t.Helper()
	b, err := p.Bind(src)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// A frozen owner (its events and progress record flushed, the commit not
// yet sent) is fenced by B, which commits; A's commit then fails, its
// events and its progress record stay invisible to read_committed, and
// when both retry nothing reaches the consumer twice.
func TestTxFencedOwnerCannotCommit(t *testing.T) {
	kf := txCluster(t)
	src := brokertest.NewSettler("public.outbox", 2)
	a, b := newTx(t, kf), newTx(t, kf)
	frozen, resume := make(chan struct{}), make(chan struct{})
	var once sync.Once
	kafka.SetBeforeEnd(a, func(int) {
		once.Do(func() {
			close(frozen)
			<-resume
		})
	})
	pa, pb := bind(t, a, src), bind(t, b, src)
	ctx := t.Context()

	eA, eB := ev(1, "agg-a", 0), ev(2, "agg-b", 0)
	aErr := make(chan error, 1)
	go func() { aErr <- pa.Publish(ctx, eA) }()
	<-frozen
	// The open transaction holds the last stable offset: nothing of A's
	// is readable yet.
	if err := pb.Publish(ctx, eB); err != nil {
		t.Fatalf("B's publish (fencing A): %v", err)
	}
	close(resume)
	err := <-aErr
	if err == nil {
		t.Fatal("the fenced owner's commit succeeded")
	}
	if !core.IsUndeliverable(err) {
		t.Errorf("fenced commit error %v is not undeliverable: the relay would back off as from a dead broker", err)
	}
	t.Logf("A's commit: %v", err)

	addrs := kf.ListenAddrs()
	if got := ids(drain(t, addrs, "order", kgo.ReadCommitted())); !slices.Equal(got, []string{eB.ID}) {
		t.Fatalf("read_committed sees %v, want only B's %s", got, eB.ID)
	}
	checkProgressInTransaction(t, addrs, "outbox.progress.public.outbox", eA, eB)

	// Both engines retry: A takes the unit back (fencing B) and, finding
	// B's event committed, publishes its own; B's retry of its event
	// returns nil at once (B committed it). B's next event goes through
	// its fenced producer: refused as undeliverable, then published once
	// B took the unit back, which finds A's event committed.
	if err := pa.Publish(ctx, eA); err != nil {
		t.Fatalf("A's retry: %v", err)
	}
	if err := pb.Publish(ctx, eB); err != nil {
		t.Fatalf("B's retry of its committed event: %v", err)
	}
	eB2 := ev(3, "agg-c", 0)
	if err := pb.Publish(ctx, eB2); !core.IsUndeliverable(err) {
		t.Fatalf("publish through a fenced producer: %v, want an undeliverable error", err)
	}
	if err := pb.Publish(ctx, eB2); err != nil {
		t.Fatalf("B's publish after taking the unit back: %v", err)
	}
	if err := pa.Publish(ctx, eA); !core.IsUndeliverable(err) && err != nil {
		t.Fatalf("A's publish of its committed event, fenced again: %v", err)
	}
	want := []string{eA.ID, eB.ID, eB2.ID}
	if got := ids(drain(t, addrs, "order", kgo.ReadCommitted())); !slices.Equal(got, want) {
		t.Fatalf("read_committed sees %v, want each of %v once", got, want)
	}
}

// checkProgressInTransaction fails when a progress record is written
// outside its events' transaction: aborted is an event whose transaction
// was aborted (fenced), committed one whose transaction committed.
func checkProgressInTransaction(t *testing.T, addrs []string, progress string, aborted, committed *core.Event) {
	t.Helper()
	// No committed progress record names the aborted event, and one
	// names the committed event.
	named := false
	for _, r := range drain(t, addrs, progress, kgo.ReadCommitted()) {
		got := progressIDs(t, r)
		if slices.Contains(got, aborted.ID) {
			t.Errorf("a committed progress record (offset %d) names %s, whose transaction was aborted", r.Offset, aborted.ID)
		}
		named = named || slices.Contains(got, committed.ID)
	}
	if !named {
		t.Errorf("no committed progress record names %s", committed.ID)
	}
	// The aborted transaction did write a progress record naming its
	// event, from the same producer session as the event itself.
	type session struct {
		id    int64
		epoch int16
	}
	sessions := map[string][]session{}
	for _, r := range drain(t, addrs, "order", kgo.ReadUncommitted()) {
		id := header(r, "event_id")
		sessions[id] = append(sessions[id], session{r.ProducerID, r.ProducerEpoch})
	}
	found := false
	for _, r := range drain(t, addrs, progress, kgo.ReadUncommitted()) {
		if !slices.Contains(progressIDs(t, r), aborted.ID) {
			continue
		}
		found = true
		if !slices.Contains(sessions[aborted.ID], session{r.ProducerID, r.ProducerEpoch}) {
			t.Errorf("the progress record naming %s was written by producer %d epoch %d; the event by %v: not one transaction",
				aborted.ID, r.ProducerID, r.ProducerEpoch, sessions[aborted.ID])
		}
	}
	if !found {
		t.Errorf("no progress record, committed or not, names %s: it was not written in the event's transaction", aborted.ID)
	}
}

// A commits, then dies before the engine records anything; B takes over
// and is offered the same events again: it returns nil for each without
// sending a second copy.
func TestTxTakeOverSkipsCommitted(t *testing.T) {
	kf := txCluster(t)
	src := brokertest.NewSettler("public.outbox", 4)
	a := newTx(t, kf)
	pa := bind(t, a, src)
	var events []*core.Event
	for i := range 12 {
		agg := "agg-" + strconv.Itoa(i)
		events = append(events, ev(int64(i+1), agg, src.Unit(agg)))
	}
	for _, e := range events {
		if err := pa.Publish(t.Context(), e); err != nil {
			t.Fatal(err)
		}
	}
	_ = a.Close() // the relay dies: nothing was recorded in the source

	b := newTx(t, kf)
	pb := bind(t, b, src)
	for _, e := range events {
		if err := pb.Publish(t.Context(), e); err != nil {
			t.Fatalf("take-over publish of committed event %d: %v", e.Seq, err)
		}
	}
	fresh := ev(100, "agg-new", src.Unit("agg-new"))
	if err := pb.Publish(t.Context(), fresh); err != nil {
		t.Fatal(err)
	}
	addrs := kf.ListenAddrs()
	want := []string{fresh.ID}
	for _, e := range events {
		want = append(want, e.ID)
	}
	slices.Sort(want)
	for _, level := range []kgo.IsolationLevel{kgo.ReadCommitted(), kgo.ReadUncommitted()} {
		if got := ids(drain(t, addrs, "order", level)); !slices.Equal(got, want) {
			t.Fatalf("topic holds %v, want %v once each", got, want)
		}
	}
	// Once the source settles them, they are forgotten: a replay is then
	// a new delivery.
	src.Settle(events[0].ID)
	time.Sleep(400 * time.Millisecond)
	if err := pb.Publish(t.Context(), ev(101, "agg-0", src.Unit("agg-0"))); err != nil {
		t.Fatal(err)
	}
	time.Sleep(400 * time.Millisecond)
	if err := pb.Publish(t.Context(), ev(102, "agg-0", src.Unit("agg-0"))); err != nil {
		t.Fatal(err)
	}
	if err := pb.Publish(t.Context(), events[0]); err != nil {
		t.Fatal(err)
	}
	if got := ids(drain(t, addrs, "order", kgo.ReadCommitted())); len(got) != len(want)+3 {
		t.Fatalf("after settling and replaying %s: %d records, want %d", events[0].ID, len(got), len(want)+3)
	}
}

// The same event sent by the plain and the exactly-once publisher lands
// with the same key, value, headers and partition.
func TestTxRecordsMatchPlainPath(t *testing.T) {
	kf := txCluster(t)
	plain, err := kafka.New(t.Context(), kafka.Config{Brokers: kf.ListenAddrs()}, &brokers.Routing{TopicPrefix: "plain-"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	tx, err := kafka.NewTx(t.Context(), txConfig(kf), &brokers.Routing{TopicPrefix: "tx-"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Close()
	src := brokertest.NewSettler("public.outbox", 4)
	bound := bind(t, tx, src)
	const n = 40
	for i := range n {
		e := ev(int64(i+1), fmt.Sprintf("kunde/ü-%d", i), 0)
		e.Unit = src.Unit(e.AggregateID)
		e.Headers = map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tenant": "acme"}
		e.ContentType = "application/x-protobuf"
		e.Payload = []byte{0, 0xff, byte(i)}
		if i == 0 {
			e.AggregateID = "" // an empty key
		}
		for _, p := range []core.Publisher{plain, bound} {
			if err := p.Publish(t.Context(), e); err != nil {
				t.Fatal(err)
			}
		}
	}
	addrs := kf.ListenAddrs()
	byID := func(recs []*kgo.Record) map[string]*kgo.Record {
		m := map[string]*kgo.Record{}
		for _, r := range recs {
			m[header(r, "event_id")] = r
		}
		return m
	}
	p := byID(consume(t, addrs, "plain-order", n, kgo.ReadCommitted()))
	x := byID(consume(t, addrs, "tx-order", n, kgo.ReadCommitted()))
	for id, pr := range p {
		xr, ok := x[id]
		if !ok {
			t.Fatalf("event %s missing from the exactly-once topic", id)
		}
		if string(pr.Key) != string(xr.Key) || string(pr.Value) != string(xr.Value) || pr.Partition != xr.Partition {
			t.Errorf("event %s: plain key %q value %x partition %d; exactly-once key %q value %x partition %d",
				id, pr.Key, pr.Value, pr.Partition, xr.Key, xr.Value, xr.Partition)
		}
		hp, hx := headers(pr), headers(xr)
		if !maps.Equal(hp, hx) || len(pr.Headers) != len(xr.Headers) {
			t.Errorf("event %s: plain headers %v, exactly-once headers %v", id, hp, hx)
		}
	}
	parts := map[int32]bool{}
	for _, r := range x {
		parts[r.Partition] = true
	}
	if len(parts) < 2 {
		t.Errorf("every event landed in partitions %v: the comparison proves little", parts)
	}
}

func headers(r *kgo.Record) map[string]string {
	h := map[string]string{}
	for _, kv := range r.Headers {
		h[kv.Key] = string(kv.Value)
	}
	return h
}

// A publish whose ctx ends while its transaction commits returns the ctx
// error; the transaction still commits, and the engine's retry returns
// nil without a second copy, as does a retry queued while it runs.
func TestTxTimedOutPublishIsNotSentTwice(t *testing.T) {
	kf := txCluster(t)
	src := brokertest.NewSettler("public.outbox", 1)
	p := newTx(t, kf)
	held, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	kafka.SetBeforeEnd(p, func(int) {
		once.Do(func() {
			close(held)
			<-release
		})
	})
	pub := bind(t, p, src)
	e := ev(1, "agg", 0)
	ctx, cancel := context.WithCancel(t.Context())
	first := make(chan error, 1)
	go func() { first <- pub.Publish(ctx, e) }()
	<-held
	cancel()
	if err := <-first; err == nil || !errors.Is(err, context.Canceled) {
		t.Fatalf("publish whose ctx ended mid-commit: %v, want the ctx error", err)
	}
	retry := make(chan error, 1)
	go func() { retry <- pub.Publish(t.Context(), e) }() // queued while the transaction commits
	time.Sleep(50 * time.Millisecond)
	close(release)
	if err := <-retry; err != nil {
		t.Fatalf("retry: %v", err)
	}
	if err := pub.Publish(t.Context(), e); err != nil {
		t.Fatalf("second retry: %v", err)
	}
	if got := ids(drain(t, kf.ListenAddrs(), "order", kgo.ReadUncommitted())); !slices.Equal(got, []string{e.ID}) {
		t.Fatalf("topic holds %v, want %s once", got, e.ID)
	}
}

// A source bound again (each log relay session binds its stream) gets the
// same publisher, which still knows what it committed; a relay that took
// over says a committed event is in Kafka already (core.Committer), and
// an operator's replay of it is sent again, as a new delivery.
func TestTxBindAgainSentAndReplay(t *testing.T) {
	kf := txCluster(t)
	src := brokertest.NewSettler("public.outbox", 2)
	a := newTx(t, kf)
	pa := bind(t, a, src)
	e := ev(1, "agg-1", src.Unit("agg-1"))
	if err := pa.Publish(t.Context(), e); err != nil {
		t.Fatal(err)
	}
	if again := bind(t, a, brokertest.NewSettler("public.outbox", 2)); again != pa {
		t.Fatal("binding a source of the same name again made a second publisher")
	}
	_ = a.Close() // dies before the source recorded e

	b := newTx(t, kf)
	pb := bind(t, b, src).(core.Committer)
	if sent, err := pb.Sent(t.Context(), e); err != nil || !sent {
		t.Fatalf("Sent(committed event) = %v, %v; want true", sent, err)
	}
	other := ev(2, "agg-1", e.Unit)
	if sent, err := pb.Sent(t.Context(), other); err != nil || sent {
		t.Fatalf("Sent(event never published) = %v, %v; want false", sent, err)
	}
	replay := *e
	replay.Replays = 1
	if sent, err := pb.Sent(t.Context(), &replay); err != nil || sent {
		t.Fatalf("Sent(replayed event) = %v, %v; want false: a replay is a new delivery", sent, err)
	}
	if err := pb.(core.Publisher).Publish(t.Context(), e); err != nil {
		t.Fatal(err)
	}
	if err := pb.(core.Publisher).Publish(t.Context(), &replay); err != nil {
		t.Fatal(err)
	}
	got := drain(t, kf.ListenAddrs(), "order", kgo.ReadCommitted())
	if n := len(got); n != 2 {
		t.Fatalf("%d records of the event read committed, want 2: the first send and the replay", n)
	}
}
