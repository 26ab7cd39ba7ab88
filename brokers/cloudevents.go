package brokers

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/url"
	"sync"
	"time"

	"github.com/outboxhq/outbox/core"
)

// CloudEvents configures the CloudEvents 1.0 binary-mode binding: each
// message carries the context attributes id (the event_id), source, type
// (the event type), specversion and time (when the event was written) as
// headers named by the broker's binding, and datacontenttype in the
// broker's content-type place, which every adapter fills anyway. The
// payload stays the event's bytes, so consumers on a CloudEvents SDK read
// the events without custom code and others see no change.
type CloudEvents struct {
	// Source is the CloudEvents source attribute, a URI reference naming
	// the producing service, such as "/shop/orders" or
	// "https://shop.example.com/orders"; required.
	Source string `koanf:"source"`
}

// Validate reports a missing or malformed Source.
func (c CloudEvents) Validate() error {
	if c.Source == "" {
		return errors.New("cloudevents.source is empty")
	}
	if _, err := url.Parse(c.Source); err != nil {
		return fmt.Errorf("cloudevents.source %q is not a URI reference", c.Source)
	}
	return nil
}

// CloudEventsBinding is how one broker carries CloudEvents attributes in
// binary mode.
type CloudEventsBinding struct {
	// Prefix comes before each attribute name: "ce_" for Kafka, "ce-"
	// for Pub/Sub, "cloudEvents_" for AMQP.
	Prefix string
}

var (
	bindingsMu sync.RWMutex
	bindings   = map[string]CloudEventsBinding{}
)

// RegisterCloudEventsBinding records the binding of the broker registered
// as name; adapters call it in their init function.
func RegisterCloudEventsBinding(name string, b CloudEventsBinding) {
	bindingsMu.Lock()
	defer bindingsMu.Unlock()
	bindings[name] = b
}

// CloudEventsBindingFor returns the binding registered for broker name,
// or the Kafka binding's "ce_" prefix, which HTTP-style consumers read too.
func CloudEventsBindingFor(name string) CloudEventsBinding {
	bindingsMu.RLock()
	defer bindingsMu.RUnlock()
	if b, ok := bindings[name]; ok {
		return b
	}
	return CloudEventsBinding{Prefix: "ce_"}
}

// WithCloudEvents wraps pub so every event it publishes carries the
// CloudEvents attributes under binding b. The attributes replace any
// header of the same name the producer set. The wrapper keeps pub's
// optional capabilities: core.Pinger, and core.Binder, whose Bind binds
// pub and wraps the result the same way.
func WithCloudEvents(pub core.Publisher, c CloudEvents, b CloudEventsBinding) (core.Publisher, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	if b.Prefix == "" {
		return nil, errors.New("cloudevents: the binding has no attribute prefix")
	}
	return (&ceWrapper{Publisher: pub, c: c, b: b}).withCapabilities(), nil
}

// withCapabilities returns w with the optional capabilities of the
// publisher it wraps.
func (w *ceWrapper) withCapabilities() core.Publisher {
	var out core.Publisher = w
	pinger, canPing := w.Publisher.(core.Pinger)
	if canPing {
		out = &ceWrapperPinger{ceWrapper: w, pinger: pinger}
	}
	if binder, ok := w.Publisher.(core.Binder); ok {
		b := &ceWrapperBinder{Publisher: out, wrapped: w, binder: binder}
		if canPing {
			return &ceWrapperBinderPinger{ceWrapperBinder: b, pinger: pinger}
		}
		return b
	}
	return out
}

type ceWrapper struct {
	core.Publisher
	c CloudEvents
	b CloudEventsBinding
}

// Sent implements core.Committer for the publisher it wraps, when that is
// one; otherwise nothing is known sent, and the relay goes on as without.
func (w *ceWrapper) Sent(ctx context.Context, e *core.Event) (bool, error) {
	if c, ok := w.Publisher.(core.Committer); ok {
		return c.Sent(ctx, e)
	}
	return false, nil
}

func (w *ceWrapper) Publish(ctx context.Context, e *core.Event) error {
	ev := *e
	ev.Headers = make(map[string]string, len(e.Headers)+6)
	maps.Copy(ev.Headers, e.Headers)
	p := w.b.Prefix
	ev.Headers[p+"specversion"] = "1.0"
	ev.Headers[p+"id"] = e.ID
	ev.Headers[p+"source"] = w.c.Source
	ev.Headers[p+"type"] = e.Type
	if !e.CreatedAt.IsZero() {
		ev.Headers[p+"time"] = e.CreatedAt.UTC().Format(time.RFC3339Nano)
	}
	return w.Publisher.Publish(ctx, &ev)
}

type ceWrapperPinger struct {
	*ceWrapper
	pinger core.Pinger
}

func (w *ceWrapperPinger) Ping(ctx context.Context) error { return w.pinger.Ping(ctx) }

// ceWrapperBinder wraps a core.Binder: the publisher Bind returns carries
// the attributes too.
type ceWrapperBinder struct {
	core.Publisher
	wrapped *ceWrapper
	binder  core.Binder
}

func (w *ceWrapperBinder) Bind(src core.Source) (core.Publisher, error) {
	inner, err := w.binder.Bind(src)
	if err != nil {
		return nil, err
	}
	return (&ceWrapper{Publisher: inner, c: w.wrapped.c, b: w.wrapped.b}).withCapabilities(), nil
}

type ceWrapperBinderPinger struct {
	*ceWrapperBinder
	pinger core.Pinger
}

func (w *ceWrapperBinderPinger) Ping(ctx context.Context) error { return w.pinger.Ping(ctx) }
