package amqp_test

import (
	"bytes"
	"context"
	"log/slog"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/amqp"
	"github.com/outboxhq/outbox/brokers/brokertest"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// Watermill's connection watcher waits forever for a reconnect when
		// the publisher is closed while the broker is unreachable.
		goleak.IgnoreTopFunction("github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp.(*ConnectionWrapper).handleConnectionClose"),
	)
}

// dropSignal is a log handler that reports when the publisher has seen
// its connection drop.
type dropSignal struct {
	slog.Handler
	dropped chan struct{}
}

func newDropSignal() *dropSignal {
	return &dropSignal{Handler: slog.DiscardHandler, dropped: make(chan struct{}, 1)}
}

func (d *dropSignal) Enabled(context.Context, slog.Level) bool { return true }

func (d *dropSignal) Handle(_ context.Context, r slog.Record) error {
	if strings.Contains(r.Message, "amqp connection closed") {
		select {
		case d.dropped <- struct{}{}:
		default:
		}
	}
	return nil
}

// rabbitURL is the test server's URL; tests skip without one, and fail
// without one under CI.
func rabbitURL(t testing.TB) string {
	t.Helper()
	u := os.Getenv("OUTBOX_TEST_AMQP_URL")
	if u == "" || u == "none" {
		if os.Getenv("CI") == "true" {
			t.Fatal("OUTBOX_TEST_AMQP_URL is not set")
		}
		t.Skip("OUTBOX_TEST_AMQP_URL is not set (scripts/services.sh sets it)")
	}
	return u
}

// viaProxy returns the URL rewritten to go through a proxy the test can cut.
func viaProxy(t testing.TB, raw string) (string, *brokertest.Proxy) {
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	p := brokertest.NewProxy(t, u.Host)
	u.Host = p.Addr()
	return u.String(), p
}

// read consumes n messages from the queue named topic.
func read(t *testing.T, raw, queue string, n int) []brokertest.Received {
	t.Helper()
	conn, err := amqp091.Dial(raw)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	deliveries, err := ch.Consume(queue, "", true, false, false, false, nil)
	if err != nil {
		t.Fatalf("consume %s: %v", queue, err)
	}
	timeout := time.After(20 * time.Second)
	var got []brokertest.Received
	for len(got) < n {
		select {
		case d := <-deliveries:
			h := map[string]string{}
			for k, v := range d.Headers {
				h[k], _ = v.(string)
			}
			if d.DeliveryMode != amqp091.Persistent {
				t.Errorf("delivery mode %d, want persistent", d.DeliveryMode)
			}
			if d.MessageId != h[event.HeaderEventID] {
				t.Errorf("message id %q, want the event uid %q", d.MessageId, h[event.HeaderEventID])
			}
			got = append(got, brokertest.Received{Headers: h, ContentType: d.ContentType, Body: d.Body})
		case <-timeout:
			t.Fatalf("queue %s: %d messages, want %d", queue, len(got), n)
		}
	}
	return got
}

func TestConformance(t *testing.T) {
	raw := rabbitURL(t)
	var (
		proxy *brokertest.Proxy
		drop  *dropSignal
	)
	brokertest.Run(t, brokertest.Harness{
		Open: func(t *testing.T, r *brokers.Routing, topics []string) core.Publisher {
			// Each topic's queue, as a consuming service binds it: the
			// publisher declares none.
			for _, tp := range topics {
				bindQueue(t, raw, tp, tp, tp)
			}
			var u string
			u, proxy = viaProxy(t, raw)
			drop = newDropSignal()
			pub, err := amqp.New(t.Context(), amqp.Config{URL: u, Channels: 8}, r, slog.New(drop))
			if err != nil {
				t.Fatal(err)
			}
			return pub
		},
		Read: func(t *testing.T, topic string, n int) []brokertest.Received { return read(t, raw, topic, n) },
		Stop: func(t *testing.T, _ core.Publisher) {
			proxy.Cut()
			select {
			case <-drop.dropped:
			case <-time.After(10 * time.Second):
				t.Fatal("publisher did not notice the connection drop")
			}
		},
		NoKey:       true, // AMQP has no message key: the routing key is the topic
		CloudEvents: amqp.CloudEventsBinding,
		Timeout:     20 * time.Second,
	})
}

func TestFixedExchange(t *testing.T) {
	raw := rabbitURL(t)
	pub, err := amqp.New(t.Context(), amqp.Config{URL: raw, Exchange: "outbox-test-events"}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	topic := "fixed" + strings.ReplaceAll(t.Name(), "/", "-")
	e := &core.Event{Seq: 3, ID: "u3", AggregateID: "a", Type: "x.y", Payload: []byte(`{}`)}
	r := &brokers.Routing{Fixed: topic}
	bindQueue(t, raw, "outbox-test-events", topic, topic)
	p2, err := amqp.New(t.Context(), amqp.Config{URL: raw, Exchange: "outbox-test-events"}, r, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer p2.Close()
	if err := p2.Publish(t.Context(), e); err != nil {
		t.Fatal(err)
	}
	if got := read(t, raw, topic, 1); got[0].Headers[event.HeaderEventSeq] != "3" {
		t.Errorf("got %+v", got[0])
	}
}

func TestPermanentErrors(t *testing.T) {
	raw := rabbitURL(t)
	conn, err := amqp091.Dial(raw)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	// An exchange already declared with other arguments than ours.
	clash := "clash-" + time.Now().Format("150405.000000")
	if err := ch.ExchangeDeclare(clash, "fanout", false, true, false, false, nil); err != nil {
		t.Fatal(err)
	}
	pub, err := amqp.New(t.Context(), amqp.Config{URL: raw}, &brokers.Routing{Fixed: clash}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	e := &core.Event{Seq: 1, ID: "u1", AggregateID: "a", Type: "t.x", Payload: []byte(`{}`)}
	if err := pub.Publish(t.Context(), e); !core.IsPermanent(err) {
		t.Errorf("publish to an exchange declared differently: %v, want a permanent error", err)
	}

	// Passive: the exchange does not exist.
	passive, err := amqp.New(t.Context(), amqp.Config{URL: raw, Passive: true}, &brokers.Routing{Fixed: "missing-" + clash}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer passive.Close()
	if err := passive.Publish(t.Context(), e); !core.IsPermanent(err) {
		t.Errorf("passive publish to a missing exchange: %v, want a permanent error", err)
	}
	// The publisher recovers its channel and goes on after such errors.
	good := &core.Event{Seq: 2, ID: "u2", AggregateID: "a", Type: "t.x", Payload: []byte(`{}`)}
	if err := pub.Publish(t.Context(), &core.Event{Seq: 2, ID: "u2", AggregateID: "a", Type: "t.x"}); !core.IsPermanent(err) {
		t.Errorf("second publish to the clashing exchange: %v", err)
	}
	ok, err := amqp.New(t.Context(), amqp.Config{URL: raw, TopicQueues: true}, &brokers.Routing{TopicPrefix: clash + "-"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ok.Close()
	t.Cleanup(func() { deleteQueue(t, raw, clash+"-t.x") })
	if err := ok.Publish(t.Context(), good); err != nil {
		t.Errorf("publish to a fresh topic: %v", err)
	}
}

func TestCredentialsNotLeaked(t *testing.T) {
	raw := rabbitURL(t)
	u, _ := url.Parse(raw)
	const secret = "not-the-password-7Hq"
	var logs bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	for _, s := range []amqp.Config{
		{URL: raw, User: "guest", Password: secret},
		{URL: "amqp://guest:" + secret + "@" + u.Host + "/"},
		{URL: "amqp://guest:" + secret + "@127.0.0.1:1/"}, // nothing listens
	} {
		_, err := amqp.New(t.Context(), s, nil, log)
		if err == nil {
			t.Fatal("connect with a wrong password succeeded")
		}
		if strings.Contains(err.Error(), secret) {
			t.Errorf("error shows the password: %v", err)
		}
	}
	if strings.Contains(logs.String(), secret) {
		t.Errorf("log shows the password:\n%s", logs.String())
	}
}

func TestValidate(t *testing.T) {
	cases := []struct {
		s    amqp.Config
		want string
	}{
		{amqp.Config{}, "amqp: url is empty"},
		{amqp.Config{URL: "http://h:5672/"}, "amqp: url: scheme"},
		{amqp.Config{URL: "amqp:///"}, "amqp: url has no host"},
		{amqp.Config{URL: "amqp://h/", Password: "x"}, "amqp: password is set but user is empty"},
		{amqp.Config{URL: "amqp://h/", ExchangeType: "x-delayed"}, "amqp: exchange_type"},
		{amqp.Config{URL: "amqp://h/", Channels: -1}, "amqp: channels"},
		{amqp.Config{URL: "amqp://h/", Passive: true, TopicQueues: true}, "amqp: topic_queues"},
		{amqp.Config{URL: "amqp://u:pw-9x@h/%zz"}, "amqp: url is not a valid URL"},
	}
	for _, c := range cases {
		err := c.s.Validate()
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Validate(%+v) = %v, want %q", c.s, err, c.want)
		}
		if err != nil && strings.Contains(err.Error(), "pw-9x") {
			t.Errorf("error shows the password: %v", err)
		}
	}
}

func TestRegistered(t *testing.T) {
	raw := rabbitURL(t)
	cfg := brokers.DecoderFunc(func(v any) error {
		*(v.(*amqp.Config)) = amqp.Config{URL: raw, Channels: 2}
		return nil
	})
	pub, err := brokers.Open(t.Context(), "amqp", brokers.Options{Config: cfg})
	if err != nil {
		t.Fatal(err)
	}
	_ = pub.Close()
}

// The broker stalls, black-holes or half-opens behind a proxy: publishes,
// pings and Close stay bounded, and a relay resumes within 2s of the heal.
// The heartbeat (5s: the library gives up on a silent broker after 15s)
// outlasts each case, so a publish stays stuck in the library the way it
// does in production, and only the publisher's own bounds end it. The
// chaos suite's freeze-broker covers the other path, a connection that
// drops while publishes wait.
func TestStalls(t *testing.T) {
	raw := rabbitURL(t)
	brokertest.RunStalls(t, brokertest.StallHarness{
		Open: func(t *testing.T, r *brokers.Routing, topics []string) (core.Publisher, *brokertest.Proxy) {
			for _, tp := range topics {
				bindQueue(t, raw, tp, tp, tp)
			}
			u, proxy := viaProxy(t, raw)
			pub, err := amqp.New(t.Context(), amqp.Config{URL: u, Channels: 4, Heartbeat: 5 * time.Second, ConnectTimeout: 2 * time.Second}, r, brokertest.Logger(t))
			if err != nil {
				t.Fatal(err)
			}
			return pub, proxy
		},
	})
}
