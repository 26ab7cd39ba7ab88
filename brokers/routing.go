package brokers

import (
	"errors"
	"fmt"
	"strings"

	"github.com/outboxhq/outbox/core"
)

// Routing maps an event type to a topic, for events whose producer named
// none (core.Event.Topic). Rules are tried in this order:
// an exact entry in Types, the longest matching entry in Prefixes, the fixed
// Fixed topic, and then the part of the type before its first dot, as
// "order.placed" goes to "order".
type Routing struct {
	Types    map[string]string `koanf:"types"`    // exact type -> topic
	Prefixes map[string]string `koanf:"prefixes"` // type prefix -> topic
	Fixed    string            `koanf:"topic"`    // every other type
	// TopicPrefix is prepended to every resolved topic, such as "prod.".
	TopicPrefix string `koanf:"topic_prefix"`
}

// ErrNoRoute is wrapped by Topic when no rule resolves a type.
var ErrNoRoute = errors.New("no topic route")

// Validate reports rules that could never route: empty keys or topics.
func (r *Routing) Validate() error {
	for k, v := range r.Types {
		if k == "" || v == "" {
			return fmt.Errorf("routing.types: entry %q: %q needs a type and a topic", k, v)
		}
	}
	for k, v := range r.Prefixes {
		if k == "" || v == "" {
			return fmt.Errorf("routing.prefixes: entry %q: %q needs a prefix and a topic", k, v)
		}
	}
	return nil
}

// Topic resolves the topic of e: the topic the producer set on the event,
// or else the rules' choice for its type, with TopicPrefix before either.
// A type with no rule and no dot has no route: the error wraps ErrNoRoute
// and is permanent, since retrying the same event cannot change the answer
// until the rules change.
func (r *Routing) Topic(e *core.Event) (string, error) {
	if e.Topic != "" {
		return r.TopicPrefix + e.Topic, nil
	}
	t, ok := r.resolve(e.Type)
	if !ok {
		return "", core.Permanent(fmt.Errorf("event type %q: %w (add a routing rule)", e.Type, ErrNoRoute))
	}
	return r.TopicPrefix + t, nil
}

func (r *Routing) resolve(typ string) (string, bool) {
	if t, ok := r.Types[typ]; ok {
		return t, true
	}
	best, found := "", false
	for prefix := range r.Prefixes {
		if strings.HasPrefix(typ, prefix) && (!found || len(prefix) > len(best)) {
			best, found = prefix, true
		}
	}
	if found {
		return r.Prefixes[best], true
	}
	if r.Fixed != "" {
		return r.Fixed, true
	}
	if head, _, ok := strings.Cut(typ, "."); ok && head != "" {
		return head, true
	}
	return "", false
}
