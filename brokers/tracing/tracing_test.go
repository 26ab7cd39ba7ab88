package tracing_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/goleak"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/brokers/tracing"
	"github.com/outboxhq/outbox/brokers/wm"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store/table"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("github.com/jackc/pgx/v5/pgxpool.(*Pool).backgroundHealthCheck"))
}

func newProvider() (*sdktrace.TracerProvider, *tracetest.SpanRecorder) {
	rec := tracetest.NewSpanRecorder()
	return sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)), rec
}

// broker keeps the Watermill messages the adapter would send.
type broker struct {
	mu   sync.Mutex
	msgs []*message.Message
	err  error
}

func (b *broker) Publish(_ context.Context, e *core.Event) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.err != nil {
		return b.err
	}
	b.msgs = append(b.msgs, wm.NewMessage(e))
	return nil
}

func (b *broker) Close() error { return nil }

func (b *broker) received() []*message.Message {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]*message.Message(nil), b.msgs...)
}

// One trace from the producer's request, through the relay's publish, to
// the consumer's handler, across a real outbox table.
func TestTraceSpansProducerRelayConsumer(t *testing.T) {
	tp, rec := newProvider()
	defer tp.Shutdown(context.Background())
	prop := propagation.TraceContext{}
	pool, cfg := pgtest.Schema(t)
	ctx := context.Background()

	w, err := outbox.NewWriter(outbox.WriterOptions{Store: cfg, Propagator: prop})
	if err != nil {
		t.Fatal(err)
	}
	reqCtx, reqSpan := tp.Tracer("producer").Start(ctx, "POST /orders")
	tx, err := pool.Begin(reqCtx)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Write(reqCtx, tx, outbox.Message{AggregateID: uuid.NewString(), Type: "order.placed", Payload: map[string]int{"n": 1}}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(reqCtx); err != nil {
		t.Fatal(err)
	}
	reqSpan.End()

	st, err := table.New(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	b := &broker{}
	pub, err := tracing.Wrap(b, tracing.Options{TracerProvider: tp, System: "rabbitmq",
		Destination: func(*core.Event) string { return "orders" }})
	if err != nil {
		t.Fatal(err)
	}
	r, err := core.New(st, pub, core.Options{PollInterval: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(ctx); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for len(b.received()) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("nothing published in 10s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := r.Stop(ctx); err != nil {
		t.Fatal(err)
	}

	msg := b.received()[0]
	consumerCtx := prop.Extract(ctx, propagation.MapCarrier(msg.Metadata))
	_, consumerSpan := tp.Tracer("consumer").Start(consumerCtx, "handle order.placed", trace.WithSpanKind(trace.SpanKindConsumer))
	consumerSpan.End()

	spans := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range rec.Ended() {
		spans[s.Name()] = s
	}
	producer, relay, consumer := spans["POST /orders"], spans["publish orders"], spans["handle order.placed"]
	if producer == nil || relay == nil || consumer == nil {
		t.Fatalf("spans = %v, want producer, relay and consumer", keys(spans))
	}
	if relay.Parent().SpanID() != producer.SpanContext().SpanID() || relay.SpanContext().TraceID() != producer.SpanContext().TraceID() {
		t.Error("the relay's publish span is not a child of the producer's span")
	}
	if consumer.Parent().SpanID() != relay.SpanContext().SpanID() {
		t.Error("the consumer's span is not a child of the relay's publish span: traceparent not forwarded")
	}
	if relay.SpanKind() != trace.SpanKindProducer {
		t.Errorf("relay span kind = %v", relay.SpanKind())
	}
	attrs := map[string]string{}
	for _, a := range relay.Attributes() {
		attrs[string(a.Key)] = a.Value.String()
	}
	if attrs["messaging.message.id"] != msg.Metadata.Get(event.HeaderEventID) || attrs["messaging.system"] != "rabbitmq" ||
		attrs["messaging.destination.name"] != "orders" {
		t.Errorf("relay span attributes = %v", attrs)
	}
}

func keys(m map[string]sdktrace.ReadOnlySpan) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

func TestUntracedEventsAreLeftAlone(t *testing.T) {
	tp, rec := newProvider()
	defer tp.Shutdown(context.Background())
	b := &broker{}
	pub, err := tracing.Wrap(b, tracing.Options{TracerProvider: tp})
	if err != nil {
		t.Fatal(err)
	}
	e := &core.Event{Seq: 1, ID: uuid.NewString(), Type: "a.b", Headers: map[string]string{"k": "v"}}
	if err := pub.Publish(context.Background(), e); err != nil {
		t.Fatal(err)
	}
	if n := len(rec.Ended()); n != 0 {
		t.Errorf("%d spans for an event without trace context, want none", n)
	}
	if got := b.received()[0].Metadata.Get("traceparent"); got != "" {
		t.Errorf("traceparent %q added to an untraced event", got)
	}

	all, _ := tracing.Wrap(b, tracing.Options{TracerProvider: tp, TraceAll: true})
	if err := all.Publish(context.Background(), e); err != nil {
		t.Fatal(err)
	}
	if n := len(rec.Ended()); n != 1 {
		t.Errorf("TraceAll: %d spans, want a root span", n)
	}
	if len(e.Headers) != 1 {
		t.Errorf("the claimed event's headers were changed: %v", e.Headers)
	}
}

type pingBroker struct {
	broker
	pinged bool
}

func (p *pingBroker) Ping(context.Context) error { p.pinged = true; return nil }

func TestFailedPublishIsRecordedAndPingPassesThrough(t *testing.T) {
	tp, rec := newProvider()
	defer tp.Shutdown(context.Background())
	pb := &pingBroker{broker: broker{err: core.Permanent(errors.New("message too large"))}}
	pub, err := tracing.Wrap(pb, tracing.Options{TracerProvider: tp})
	if err != nil {
		t.Fatal(err)
	}
	pinger, ok := pub.(core.Pinger)
	if !ok {
		t.Fatal("wrapped publisher lost Ping")
	}
	_ = pinger.Ping(context.Background())
	if !pb.pinged {
		t.Error("Ping did not reach the broker")
	}
	if _, ok := mustWrap(t, &broker{}, tp).(core.Pinger); ok {
		t.Error("a publisher without Ping gained one")
	}

	ctx, parent := tp.Tracer("t").Start(context.Background(), "request")
	h := propagation.MapCarrier{}
	propagation.TraceContext{}.Inject(ctx, h)
	parent.End()
	err = pub.Publish(context.Background(), &core.Event{Seq: 7, ID: uuid.NewString(), Type: "a.b", Headers: h})
	if !core.IsPermanent(err) {
		t.Fatalf("error = %v, want the broker's permanent error unchanged", err)
	}
	var span sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.Name() == "publish" {
			span = s
		}
	}
	if span == nil || span.Status().Code != codes.Error || len(span.Events()) == 0 {
		t.Errorf("failed publish span = %+v, want error status and a recorded error", span)
	}
}

func mustWrap(t *testing.T, p core.Publisher, tp trace.TracerProvider) core.Publisher {
	t.Helper()
	w, err := tracing.Wrap(p, tracing.Options{TracerProvider: tp})
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func TestWrapRejectsMissingParts(t *testing.T) {
	tp, _ := newProvider()
	if _, err := tracing.Wrap(nil, tracing.Options{TracerProvider: tp}); err == nil {
		t.Error("nil publisher accepted")
	}
	if _, err := tracing.Wrap(&broker{}, tracing.Options{}); err == nil {
		t.Error("nil TracerProvider accepted")
	}
}

// binderBroker binds to a source, returning a broker of its own; it pings
// when ping is set.
type binderBroker struct {
	broker
	bound *pingBroker
	src   core.Source
	err   error
}

func (b *binderBroker) Bind(src core.Source) (core.Publisher, error) {
	if b.err != nil {
		return nil, b.err
	}
	b.src = src
	return b.bound, nil
}

type pingBinderBroker struct{ binderBroker }

func (p *pingBinderBroker) Ping(context.Context) error { return nil }

// A wrapped Binder binds the publisher it wraps and traces what the bound
// one publishes.
func TestWrapForwardsBind(t *testing.T) {
	tp, rec := newProvider()
	defer tp.Shutdown(context.Background())
	inner := &binderBroker{bound: &pingBroker{}}
	pub := mustWrap(t, inner, tp)
	b, ok := pub.(core.Binder)
	if !ok {
		t.Fatal("wrapped Binder lost Bind")
	}
	if _, ok := pub.(core.Pinger); ok {
		t.Error("a Binder without Ping gained one")
	}
	src := struct{ core.Source }{}
	bound, err := b.Bind(src)
	if err != nil {
		t.Fatal(err)
	}
	if inner.src != src {
		t.Error("Bind did not reach the wrapped publisher")
	}
	if _, ok := bound.(core.Pinger); !ok {
		t.Error("the bound publisher lost Ping")
	}
	ctx, parent := tp.Tracer("t").Start(context.Background(), "request")
	h := propagation.MapCarrier{}
	propagation.TraceContext{}.Inject(ctx, h)
	parent.End()
	if err := bound.Publish(context.Background(), &core.Event{Seq: 1, ID: uuid.NewString(), Type: "a.b", Headers: h}); err != nil {
		t.Fatal(err)
	}
	msgs := inner.bound.received()
	if len(msgs) != 1 || len(inner.received()) != 0 {
		t.Fatalf("bound broker got %d messages, unbound %d; want 1 and 0", len(msgs), len(inner.received()))
	}
	if got := msgs[0].Metadata.Get("traceparent"); got == "" || got == h["traceparent"] {
		t.Errorf("traceparent %q: the bound publisher's publish was not traced", got)
	}
	spans := 0
	for _, s := range rec.Ended() {
		if s.Name() == "publish" {
			spans++
		}
	}
	if spans != 1 {
		t.Errorf("%d publish spans, want 1", spans)
	}

	both := mustWrap(t, &pingBinderBroker{binderBroker{bound: &pingBroker{}}}, tp)
	if _, ok := both.(core.Pinger); !ok {
		t.Error("a pinging Binder lost Ping")
	}
	if _, ok := both.(core.Binder); !ok {
		t.Error("a pinging Binder lost Bind")
	}
	refused := mustWrap(t, &binderBroker{err: errors.New("source is not a core.Settler")}, tp)
	if _, err := refused.(core.Binder).Bind(src); err == nil || err.Error() != "source is not a core.Settler" {
		t.Errorf("Bind error = %v, want the wrapped publisher's", err)
	}
}

// committerPub says every event is in the broker already.
type committerPub struct{}

func (committerPub) Publish(context.Context, *core.Event) error { return nil }
func (committerPub) Close() error                               { return nil }
func (committerPub) Sent(context.Context, *core.Event) (bool, error) {
	return true, nil
}

// The wrapper answers core.Committer with the wrapped publisher's word, so
// an exactly-once relay does not hand off an event already in Kafka.
func TestWrapForwardsSent(t *testing.T) {
	tp, _ := newProvider()
	defer tp.Shutdown(context.Background())
	c, ok := mustWrap(t, committerPub{}, tp).(core.Committer)
	if !ok {
		t.Fatal("the wrapper is not a core.Committer")
	}
	if sent, err := c.Sent(context.Background(), &core.Event{Seq: 1}); err != nil || !sent {
		t.Fatalf("Sent = %v, %v; want the wrapped publisher's true", sent, err)
	}
}
