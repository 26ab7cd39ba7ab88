package brokers_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/core"
)

func TestRoutingRules(t *testing.T) {
	r := &brokers.Routing{
		Types:       map[string]string{"order.placed": "orders-placed"},
		Prefixes:    map[string]string{"order.": "orders", "order.refund": "refunds"},
		TopicPrefix: "prod.",
	}
	if err := r.Validate(); err != nil {
		t.Fatal(err)
	}
	for typ, want := range map[string]string{
		"order.placed":        "prod.orders-placed", // exact beats prefix
		"order.shipped":       "prod.orders",
		"order.refund.issued": "prod.refunds", // longest prefix wins
		"invoice.sent":        "prod.invoice", // before the first dot
	} {
		got, err := r.Topic(&core.Event{Type: typ})
		if err != nil || got != want {
			t.Errorf("Topic(%q) = %q, %v; want %q", typ, got, err, want)
		}
	}
	_, err := r.Topic(&core.Event{Type: "nodot"})
	if !errors.Is(err, brokers.ErrNoRoute) || !core.IsPermanent(err) {
		t.Fatalf("unroutable type: %v, want a permanent ErrNoRoute", err)
	}
	fixed := &brokers.Routing{Fixed: "all"}
	if got, err := fixed.Topic(&core.Event{Type: "nodot"}); err != nil || got != "all" {
		t.Fatalf("fixed topic: %q, %v", got, err)
	}
	if err := (&brokers.Routing{Prefixes: map[string]string{"": "x"}}).Validate(); err == nil {
		t.Fatal("an empty prefix passed validation")
	}
	if err := (&brokers.Routing{Types: map[string]string{"a": ""}}).Validate(); err == nil {
		t.Fatal("an empty topic passed validation")
	}
}

// FuzzRouting resolves arbitrary types against arbitrary valid rules: it
// must never panic, a resolved topic is never empty, the exact rule wins,
// and an unresolved type is a permanent ErrNoRoute.
func FuzzRouting(f *testing.F) {
	f.Add("order.placed", "order.placed", "orders", "order.", "o", "order.pl", "op", "", "prod.")
	f.Add("nodot", "", "", "", "", "", "", "", "")
	f.Add(".leading", "x", "y", ".", "dot", "", "", "", "")
	f.Add("a.b.c", "", "", "a", "A", "a.b", "AB", "fixed", "")
	f.Add("\xff.\x00", "\xff", "t", "", "", "", "", "", "p-")
	f.Fuzz(func(t *testing.T, typ, exact, exactTopic, p1, t1, p2, t2, fixed, topicPrefix string) {
		r := &brokers.Routing{Types: map[string]string{}, Prefixes: map[string]string{}, Fixed: fixed, TopicPrefix: topicPrefix}
		if exact != "" && exactTopic != "" {
			r.Types[exact] = exactTopic
		}
		for _, p := range [][2]string{{p1, t1}, {p2, t2}} {
			if p[0] != "" && p[1] != "" {
				r.Prefixes[p[0]] = p[1]
			}
		}
		if err := r.Validate(); err != nil {
			t.Fatalf("rules built from non-empty entries failed validation: %v", err)
		}
		topic, err := r.Topic(&core.Event{Type: typ})
		if err != nil {
			if !errors.Is(err, brokers.ErrNoRoute) || !core.IsPermanent(err) {
				t.Fatalf("error %v is not a permanent ErrNoRoute", err)
			}
			if fixed != "" || len(r.Types)+len(r.Prefixes) > 0 && routable(r, typ) {
				t.Fatalf("type %q has a rule but got no route", typ)
			}
			return
		}
		if topic == "" || topic == topicPrefix {
			t.Fatalf("type %q resolved to the empty topic (%q)", typ, topic)
		}
		if !strings.HasPrefix(topic, topicPrefix) {
			t.Fatalf("topic %q lacks the prefix %q", topic, topicPrefix)
		}
		if want, ok := r.Types[typ]; ok && topic != topicPrefix+want {
			t.Fatalf("type %q has the exact rule %q but went to %q", typ, want, topic)
		}
	})
}

func routable(r *brokers.Routing, typ string) bool {
	if _, ok := r.Types[typ]; ok {
		return true
	}
	for p := range r.Prefixes {
		if strings.HasPrefix(typ, p) {
			return true
		}
	}
	return false
}
