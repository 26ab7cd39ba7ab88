// Package tracing continues the producer's trace through the relay.
//
// The producer stores the trace context of its request in the event's
// headers (outbox.WriterOptions.Propagator: a W3C "traceparent", and
// "tracestate" when present). Wrap returns a publisher that starts a
// "publish" span for each event as a child of that stored context and sends
// the broker message with a traceparent naming this span, so a consumer
// that extracts it joins one trace spanning producer, relay and consumer.
//
// Tracing is off unless a publisher is wrapped: an unwrapped relay does no
// tracing work at all.
package tracing

import (
	"context"
	"errors"
	"maps"
	"strconv"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxhq/outbox/core"
)

// ScopeName is the instrumentation scope of the relay's spans.
const ScopeName = "github.com/outboxhq/outbox/brokers/tracing"

// Options configure Wrap.
type Options struct {
	TracerProvider trace.TracerProvider // required; such as an SDK provider
	// Propagator reads the stored context and writes the outgoing one;
	// default W3C trace context (traceparent, tracestate). Use the same
	// one as the producer's WriterOptions.Propagator.
	Propagator propagation.TextMapPropagator
	// System is the messaging.system attribute, such as "kafka".
	System string
	// Destination, when set, names the topic of an event for the
	// messaging.destination.name attribute.
	Destination func(*core.Event) string
	// TraceAll starts a root span for events stored without a trace
	// context. By default those are published untraced, so a producer
	// that does not trace adds no spans.
	TraceAll bool
}

// Wrap returns pub with a span around each publish. The result implements
// core.Pinger when pub does, and core.Binder when pub does: its Bind binds
// pub and wraps the result the same way.
func Wrap(pub core.Publisher, opts Options) (core.Publisher, error) {
	if pub == nil {
		return nil, errors.New("wrap publisher for tracing: publisher is nil")
	}
	if opts.TracerProvider == nil {
		return nil, errors.New("wrap publisher for tracing: TracerProvider is nil")
	}
	if opts.Propagator == nil {
		opts.Propagator = propagation.TraceContext{}
	}
	p := &publisher{next: pub, opts: opts, tracer: opts.TracerProvider.Tracer(ScopeName)}
	return p.withCapabilities(), nil
}

// withCapabilities returns p with the optional capabilities of the
// publisher it wraps.
func (p *publisher) withCapabilities() core.Publisher {
	var out core.Publisher = p
	pinger, canPing := p.next.(core.Pinger)
	if canPing {
		out = &pingingPublisher{publisher: p, pinger: pinger}
	}
	if binder, ok := p.next.(core.Binder); ok {
		b := &bindingPublisher{Publisher: out, wrapped: p, binder: binder}
		if canPing {
			return &bindingPingingPublisher{bindingPublisher: b, pinger: pinger}
		}
		return b
	}
	return out
}

type publisher struct {
	next   core.Publisher
	opts   Options
	tracer trace.Tracer
}

var _ core.Publisher = (*publisher)(nil)

// Sent implements core.Committer for the publisher it wraps, when that is
// one; otherwise nothing is known sent, and the relay goes on as without.
func (p *publisher) Sent(ctx context.Context, e *core.Event) (bool, error) {
	if c, ok := p.next.(core.Committer); ok {
		return c.Sent(ctx, e)
	}
	return false, nil
}

// Publish implements core.Publisher. It leaves e untouched: the span's
// traceparent goes out on a copy whose headers are a new map, as the relay
// may hold on to e (and its headers) for a retry.
func (p *publisher) Publish(ctx context.Context, e *core.Event) error {
	parent := p.opts.Propagator.Extract(ctx, propagation.MapCarrier(e.Headers))
	if !trace.SpanContextFromContext(parent).IsValid() && !p.opts.TraceAll {
		return p.next.Publish(ctx, e)
	}
	attrs := []attribute.KeyValue{
		attribute.String("messaging.operation.type", "send"),
		attribute.String("messaging.message.id", e.ID),
		attribute.String("outbox.event.id", strconv.FormatInt(e.Seq, 10)),
		attribute.String("outbox.event.type", e.Type),
		attribute.String("outbox.aggregate.id", e.AggregateID),
		attribute.Int("outbox.event.attempt", e.Attempts+1),
	}
	if p.opts.System != "" {
		attrs = append(attrs, attribute.String("messaging.system", p.opts.System))
	}
	name := "publish"
	if p.opts.Destination != nil {
		if dest := p.opts.Destination(e); dest != "" {
			attrs = append(attrs, attribute.String("messaging.destination.name", dest))
			name = "publish " + dest
		}
	}
	ctx, span := p.tracer.Start(parent, name, trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(attrs...))
	defer span.End()

	out := *e
	out.Headers = make(map[string]string, len(e.Headers)+2)
	maps.Copy(out.Headers, e.Headers)
	p.opts.Propagator.Inject(ctx, propagation.MapCarrier(out.Headers))

	err := p.next.Publish(ctx, &out)
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
		span.SetAttributes(attribute.Bool("outbox.error.permanent", core.IsPermanent(err)))
	}
	return err
}

func (p *publisher) Close() error { return p.next.Close() }

type pingingPublisher struct {
	*publisher
	pinger core.Pinger
}

var (
	_ core.Publisher = (*pingingPublisher)(nil)
	_ core.Pinger    = (*pingingPublisher)(nil)
)

func (p *pingingPublisher) Ping(ctx context.Context) error { return p.pinger.Ping(ctx) }

// bindingPublisher wraps a core.Binder: the publisher Bind returns is
// traced too.
type bindingPublisher struct {
	core.Publisher
	wrapped *publisher
	binder  core.Binder
}

var _ core.Binder = (*bindingPublisher)(nil)

func (b *bindingPublisher) Bind(src core.Source) (core.Publisher, error) {
	inner, err := b.binder.Bind(src)
	if err != nil {
		return nil, err
	}
	p := *b.wrapped
	p.next = inner
	return p.withCapabilities(), nil
}

type bindingPingingPublisher struct {
	*bindingPublisher
	pinger core.Pinger
}

func (p *bindingPingingPublisher) Ping(ctx context.Context) error { return p.pinger.Ping(ctx) }
