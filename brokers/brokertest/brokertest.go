// Package brokertest is the conformance suite every publisher runs, the
// registered adapters and users' own alike. A test supplies a Harness that
// opens the publisher and reads back what reached the broker; Run checks that
// bodies (JSON, Protobuf and raw bytes), content types, any string keys,
// headers, per-event topics and the CloudEvents binding arrive intact, that per-aggregate order holds when
// a real relay publishes on parallel lanes, and that failures surface as
// errors: an unroutable type, a cancelled context, a broker that is down.
package brokertest

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
)

// Received is one message as it arrived at the broker.
type Received struct {
	Key     string            // Kafka key, Pub/Sub ordering key, or the broker's equivalent
	Headers map[string]string // headers, metadata or attributes
	// ContentType as the broker carries it natively: the content-type
	// header in Kafka, the content-type property in AMQP, the content-type
	// attribute in Pub/Sub.
	ContentType string
	Body        []byte
}

// Harness connects the suite to one publisher and its broker.
type Harness struct {
	// Open returns a publisher that routes with r. topics lists every topic
	// the case will read, for brokers that keep messages only for existing
	// subscriptions or queues. The suite closes the publisher.
	Open func(t *testing.T, r *brokers.Routing, topics []string) core.Publisher
	// Read returns the first n messages that arrived on topic, in arrival
	// order for each key, failing the test when fewer arrive in time.
	Read func(t *testing.T, topic string, n int) []Received
	// Stop makes the broker behind pub unreachable, such as by shutting it
	// down or cutting the connection (see Proxy). Nil skips that case.
	Stop func(t *testing.T, pub core.Publisher)
	// NoKey says the broker has no message key; the key cases then check
	// the aggregate_id header only.
	NoKey bool
	// JSONBody says the broker re-encodes a JSON payload as JSON (stdout
	// does); the body case then compares compacted JSON, not bytes.
	// Other payloads are always compared byte for byte.
	JSONBody bool
	// CloudEvents is the broker's CloudEvents binding, which the
	// CloudEvents case checks; the zero value means the "ce_" prefix.
	CloudEvents brokers.CloudEventsBinding
	// Timeout bounds each wait; default 30s.
	Timeout time.Duration
}

// Run runs every case as a subtest. A publisher that binds to its source
// (core.Binder) is bound to an in-memory Settler for the cases that
// publish directly, and given to the relay unbound, with a Settler as its
// source, in the order case.
func Run(t *testing.T, h Harness) {
	t.Helper()
	if h.Open == nil || h.Read == nil {
		t.Fatal("brokertest: Harness needs Open and Read")
	}
	if h.Timeout == 0 {
		h.Timeout = 30 * time.Second
	}
	s := suite{h: h}
	t.Run("BodyAndHeaders", s.bodyAndHeaders)
	t.Run("KeyIsAggregateID", s.key)
	t.Run("BinaryPayloads", s.binary)
	t.Run("Routing", s.routing)
	t.Run("TopicOnEvent", s.topicOnEvent)
	t.Run("CloudEvents", s.cloudEvents)
	t.Run("UnroutableIsPermanent", s.unroutable)
	t.Run("OrderPerKeyOnParallelLanes", s.order)
	t.Run("CancelledContext", s.cancelled)
	t.Run("BrokerDown", s.down)
}

type suite struct{ h Harness }

// open returns a publisher whose topics are unique to this test, so cases
// sharing one broker never read each other's messages.
func (s suite) open(t *testing.T, r *brokers.Routing, topics ...string) (core.Publisher, string) {
	t.Helper()
	pub, prefix := s.openUnbound(t, r, topics...)
	if b, ok := pub.(core.Binder); ok {
		bound, err := b.Bind(NewSettler(prefix+"src", 4))
		if err != nil {
			t.Fatalf("brokertest: bind the publisher: %v", err)
		}
		return bound, prefix
	}
	return pub, prefix
}

// openUnbound is open without the binding: the relay binds.
func (s suite) openUnbound(t *testing.T, r *brokers.Routing, topics ...string) (core.Publisher, string) {
	t.Helper()
	prefix := uniquePrefix()
	r.TopicPrefix = prefix
	full := make([]string, len(topics))
	for i, tp := range topics {
		full[i] = prefix + tp
	}
	pub := s.h.Open(t, r, full)
	if pub == nil {
		t.Fatal("brokertest: Open returned a nil publisher")
	}
	t.Cleanup(func() {
		if err := pub.Close(); err != nil {
			t.Logf("close publisher: %v", err)
		}
	})
	return pub, prefix
}

func uniquePrefix() string {
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	return "bt" + hex.EncodeToString(b) + "-"
}

func (s suite) ctx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), s.h.Timeout)
	t.Cleanup(cancel)
	return ctx
}

func newEvent(id int64, agg, typ string, payload string, headers map[string]string) *core.Event {
	return &core.Event{
		Seq: id, ID: fmt.Sprintf("00000000-0000-4000-8000-%012d", id), AggregateID: agg,
		Type: typ, Payload: []byte(payload), Headers: headers, CreatedAt: time.Now(),
	}
}

func (s suite) bodyAndHeaders(t *testing.T) {
	pub, prefix := s.open(t, &brokers.Routing{}, "order")
	// Bytes a careless adapter would alter: key order, spacing, unicode,
	// a trailing newline.
	payload := "{\"z\":1, \"a\":[true,null],\"s\":\"caf\u00e9 \u2603\"}\n"
	e := newEvent(41, "order-7", "order.placed", payload, map[string]string{
		"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
		"tenant":      "acme",
	})
	if err := pub.Publish(s.ctx(t), e); err != nil {
		t.Fatalf("publish: %v", err)
	}
	got := s.h.Read(t, prefix+"order", 1)[0]
	want := payload
	if s.h.JSONBody {
		var b bytes.Buffer
		if err := json.Compact(&b, []byte(payload)); err != nil {
			t.Fatal(err)
		}
		want = b.String()
	}
	if string(got.Body) != want {
		t.Errorf("body = %q, want %q", got.Body, want)
	}
	if got.ContentType != "application/json" {
		t.Errorf("content type = %q, want application/json, the default", got.ContentType)
	}
	wantHeaders := map[string]string{
		event.HeaderEventID:     e.ID,
		event.HeaderEventUID:    e.ID,
		event.HeaderEventSeq:    "41",
		event.HeaderType:        "order.placed",
		event.HeaderAggregateID: "order-7",
		"traceparent":           e.Headers["traceparent"],
		"tenant":                "acme",
	}
	for k, v := range wantHeaders {
		if got.Headers[k] != v {
			t.Errorf("header %s = %q, want %q", k, got.Headers[k], v)
		}
	}
}

func (s suite) key(t *testing.T) {
	pub, prefix := s.open(t, &brokers.Routing{}, "user")
	keys := []string{"ord_2Xb9", "9007199254740993", "kunde/ü-ß 7"}
	for i, agg := range keys {
		if err := pub.Publish(s.ctx(t), newEvent(int64(i+1), agg, "user.created", `{}`, nil)); err != nil {
			t.Fatalf("publish: %v", err)
		}
	}
	got := s.h.Read(t, prefix+"user", 3)
	seen := map[string]bool{}
	for _, m := range got {
		agg := m.Headers[event.HeaderAggregateID]
		seen[agg] = true
		if !s.h.NoKey && m.Key != agg {
			t.Errorf("key = %q, want the aggregate id %q", m.Key, agg)
		}
	}
	if len(seen) != 3 {
		t.Errorf("aggregates seen = %v, want %q", seen, keys)
	}
}

func (s suite) routing(t *testing.T) {
	pub, prefix := s.open(t, &brokers.Routing{
		Types:    map[string]string{"order.refunded": "payments"},
		Prefixes: map[string]string{"inv": "billing"},
	}, "payments", "billing", "order")
	cases := []struct{ typ, topic string }{
		{"order.refunded", "payments"}, // exact type
		{"invoice.sent", "billing"},    // prefix
		{"order.placed", "order"},      // default: before the first dot
	}
	for i, c := range cases {
		if err := pub.Publish(s.ctx(t), newEvent(int64(i+1), "r", c.typ, `{}`, nil)); err != nil {
			t.Fatalf("publish %s: %v", c.typ, err)
		}
	}
	for _, c := range cases {
		got := s.h.Read(t, prefix+c.topic, 1)
		if typ := got[0].Headers[event.HeaderType]; typ != c.typ {
			t.Errorf("topic %s got type %q, want %q", c.topic, typ, c.typ)
		}
	}
}

// binary publishes a Protobuf message and raw bytes no text encoding
// survives; both must arrive byte for byte with their content type in the
// broker's own place, and the Protobuf one must decode.
func (s suite) binary(t *testing.T) {
	pub, prefix := s.open(t, &brokers.Routing{}, "sensor")
	want, err := structpb.NewStruct(map[string]any{"id": "s-1", "celsius": 21.5, "tags": []any{"roof", "north"}})
	if err != nil {
		t.Fatal(err)
	}
	asJSON, err := protojson.Marshal(want) // a mistaken JSON re-encoding shows in the failure
	if err != nil {
		t.Fatal(err)
	}
	wire, err := proto.Marshal(want)
	if err != nil {
		t.Fatal(err)
	}
	raw := []byte{0x00, 0xff, 0xfe, '"', '\\', 0x80, '\n', 0x00}
	events := []*core.Event{
		{Seq: 1, ID: "00000000-0000-4000-8000-000000000001", AggregateID: "s-1", Type: "sensor.read",
			ContentType: "application/x-protobuf", Payload: wire, CreatedAt: time.Now()},
		{Seq: 2, ID: "00000000-0000-4000-8000-000000000002", AggregateID: "s-1", Type: "sensor.raw",
			ContentType: "application/octet-stream", Payload: raw, CreatedAt: time.Now()},
	}
	for _, e := range events {
		if err := pub.Publish(s.ctx(t), e); err != nil {
			t.Fatalf("publish %s: %v", e.Type, err)
		}
	}
	got := s.h.Read(t, prefix+"sensor", 2)
	byType := map[string]Received{}
	for _, m := range got {
		byType[m.Headers[event.HeaderType]] = m
	}
	for _, e := range events {
		m, ok := byType[e.Type]
		if !ok {
			t.Fatalf("%s did not arrive", e.Type)
		}
		if !bytes.Equal(m.Body, e.Payload) {
			t.Errorf("%s: body = %x, want %x byte for byte", e.Type, m.Body, e.Payload)
		}
		if m.ContentType != e.ContentType {
			t.Errorf("%s: content type = %q, want %q in the broker's own place", e.Type, m.ContentType, e.ContentType)
		}
	}
	var decoded structpb.Struct
	if err := proto.Unmarshal(byType["sensor.read"].Body, &decoded); err != nil {
		t.Fatalf("decode the Protobuf payload: %v", err)
	}
	if !proto.Equal(&decoded, want) {
		t.Errorf("decoded %v, want %s", &decoded, asJSON)
	}
}

// topicOnEvent: a topic the producer set wins over the routing rules, with
// the routing's prefix before it.
func (s suite) topicOnEvent(t *testing.T) {
	pub, prefix := s.open(t, &brokers.Routing{Types: map[string]string{"order.placed": "orders"}}, "orders", "vip-orders")
	e := newEvent(1, "o-1", "order.placed", `{"vip":true}`, nil)
	e.Topic = "vip-orders"
	if err := pub.Publish(s.ctx(t), e); err != nil {
		t.Fatalf("publish: %v", err)
	}
	if err := pub.Publish(s.ctx(t), newEvent(2, "o-2", "order.placed", `{}`, nil)); err != nil {
		t.Fatalf("publish: %v", err)
	}
	if got := s.h.Read(t, prefix+"vip-orders", 1)[0]; got.Headers[event.HeaderEventSeq] != "1" {
		t.Errorf("topic vip-orders got event %s, want 1", got.Headers[event.HeaderEventSeq])
	}
	if got := s.h.Read(t, prefix+"orders", 1)[0]; got.Headers[event.HeaderEventSeq] != "2" {
		t.Errorf("topic orders got event %s, want 2, routed by its type", got.Headers[event.HeaderEventSeq])
	}
}

// cloudEvents checks the binary-mode binding's rules: every required
// attribute under the binding's prefix, specversion 1.0, time in RFC 3339,
// datacontenttype as the broker's content type, the payload untouched.
func (s suite) cloudEvents(t *testing.T) {
	b := s.h.CloudEvents
	if b.Prefix == "" {
		b.Prefix = "ce_"
	}
	base, prefix := s.open(t, &brokers.Routing{}, "invoice")
	pub, err := brokers.WithCloudEvents(base, brokers.CloudEvents{Source: "/billing/invoices"}, b)
	if err != nil {
		t.Fatal(err)
	}
	created := time.Date(2026, 3, 4, 5, 6, 7, 891000000, time.UTC)
	e := &core.Event{Seq: 7, ID: "0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0d", AggregateID: "inv_8Hq2", Type: "invoice.sent",
		ContentType: "application/x-protobuf", Payload: []byte{0x0a, 0x00, 0xff}, CreatedAt: created,
		Headers: map[string]string{"tenant": "acme"}}
	if err := pub.Publish(s.ctx(t), e); err != nil {
		t.Fatalf("publish: %v", err)
	}
	if e.Headers[b.Prefix+"id"] != "" || len(e.Headers) != 1 {
		t.Errorf("the wrapper changed the caller's event: %v", e.Headers)
	}
	got := s.h.Read(t, prefix+"invoice", 1)[0]
	want := map[string]string{
		"specversion": "1.0", "id": e.ID, "source": "/billing/invoices", "type": "invoice.sent",
		"time": "2026-03-04T05:06:07.891Z",
	}
	for attr, v := range want {
		if got.Headers[b.Prefix+attr] != v {
			t.Errorf("attribute %s (header %s) = %q, want %q", attr, b.Prefix+attr, got.Headers[b.Prefix+attr], v)
		}
	}
	if _, err := time.Parse(time.RFC3339, got.Headers[b.Prefix+"time"]); err != nil {
		t.Errorf("time attribute is not RFC 3339: %v", err)
	}
	if got.Headers[b.Prefix+"datacontenttype"] != "" {
		t.Errorf("datacontenttype is a %sdatacontenttype header; binary mode puts it in the content type", b.Prefix)
	}
	if got.ContentType != e.ContentType {
		t.Errorf("content type = %q, want %q (datacontenttype)", got.ContentType, e.ContentType)
	}
	if !bytes.Equal(got.Body, e.Payload) || got.Headers["tenant"] != "acme" {
		t.Errorf("body %x, tenant %q: the binding must leave payload and headers as they are", got.Body, got.Headers["tenant"])
	}
	if _, err := brokers.WithCloudEvents(base, brokers.CloudEvents{}, b); err == nil {
		t.Error("a binding without a source was accepted")
	}
}

func (s suite) unroutable(t *testing.T) {
	pub, prefix := s.open(t, &brokers.Routing{}, "audit")
	err := pub.Publish(s.ctx(t), newEvent(1, "x", "nodots", `{}`, nil))
	if err == nil {
		t.Fatal("publish of a type with no route succeeded")
	}
	if !core.IsPermanent(err) {
		t.Errorf("error %v is not permanent", err)
	}
	if !strings.Contains(err.Error(), "nodots") {
		t.Errorf("error %q does not name the type", err)
	}
	// The publisher keeps working after an event it could not route.
	if err := pub.Publish(s.ctx(t), newEvent(2, "x", "audit.logged", `{}`, nil)); err != nil {
		t.Fatalf("publish after a routing error: %v", err)
	}
	s.h.Read(t, prefix+"audit", 1)
}

// order publishes through a real relay on parallel lanes and checks that each
// aggregate's events arrive in id order.
func (s suite) order(t *testing.T) {
	const aggregates, perAggregate = 20, 50
	pub, prefix := s.openUnbound(t, &brokers.Routing{}, "stock")
	store := NewSettler(prefix+"src", 4)
	// Interleave aggregates so every batch mixes them.
	for i := range perAggregate {
		for a := range aggregates {
			store.Add(core.Event{
				ID: fmt.Sprintf("00000000-0000-4000-8000-%06d%06d", a, i), AggregateID: fmt.Sprintf("agg-%02d", a),
				Type: "stock.moved", Payload: []byte(fmt.Sprintf(`{"seq":%d}`, i)),
			})
		}
	}
	relay, err := core.New(store, pub, core.Options{
		Lanes: 8, BatchSize: 100, PollInterval: 10 * time.Millisecond,
		ErrorBackoff: core.Backoff{Min: 10 * time.Millisecond, Max: 100 * time.Millisecond},
		RetryBackoff: core.Backoff{Min: 10 * time.Millisecond, Max: 100 * time.Millisecond},
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx := s.ctx(t)
	if err := relay.Start(ctx); err != nil {
		t.Fatal(err)
	}
	for len(store.Pending()) > 0 {
		if ctx.Err() != nil {
			t.Fatalf("relay did not publish everything: %d pending", len(store.Pending()))
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := relay.Stop(ctx); err != nil {
		t.Fatal(err)
	}

	got := s.h.Read(t, prefix+"stock", aggregates*perAggregate)
	last := map[string]int64{}
	count := map[string]int{}
	for _, m := range got {
		agg := m.Headers[event.HeaderAggregateID]
		id, err := strconv.ParseInt(m.Headers[event.HeaderEventSeq], 10, 64)
		if err != nil {
			t.Fatalf("event_seq header %q: %v", m.Headers[event.HeaderEventSeq], err)
		}
		if id <= last[agg] {
			t.Fatalf("aggregate %s: event %d arrived after %d", agg, id, last[agg])
		}
		if !s.h.NoKey && m.Key != agg {
			t.Fatalf("event %d: key %q, want %q", id, m.Key, agg)
		}
		last[agg] = id
		count[agg]++
	}
	for a := range aggregates {
		if n := count[fmt.Sprintf("agg-%02d", a)]; n != perAggregate {
			t.Errorf("aggregate agg-%02d: %d events arrived, want %d", a, n, perAggregate)
		}
	}
}

func (s suite) cancelled(t *testing.T) {
	pub, _ := s.open(t, &brokers.Routing{}, "order")
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	err := pub.Publish(ctx, newEvent(1, "c", "order.placed", `{}`, nil))
	if err == nil {
		t.Fatal("publish with a cancelled context succeeded")
	}
	if core.IsPermanent(err) {
		t.Errorf("cancellation %v is permanent; the event would be held instead of retried", err)
	}
}

func (s suite) down(t *testing.T) {
	if s.h.Stop == nil {
		t.Skip("harness cannot stop its broker")
	}
	pub, prefix := s.open(t, &brokers.Routing{}, "order")
	if err := pub.Publish(s.ctx(t), newEvent(1, "d", "order.placed", `{}`, nil)); err != nil {
		t.Fatalf("publish before the broker stops: %v", err)
	}
	s.h.Read(t, prefix+"order", 1)
	s.h.Stop(t, pub)
	ctx, cancel := context.WithTimeout(t.Context(), s.h.Timeout)
	defer cancel()
	start := time.Now()
	err := pub.Publish(ctx, newEvent(2, "d", "order.placed", `{}`, nil))
	if err == nil {
		t.Fatal("publish to a stopped broker succeeded")
	}
	t.Logf("publish to a stopped broker failed after %v: %v", time.Since(start).Round(time.Millisecond), err)
}
