package kafka_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/goleak"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/brokertest"
	"github.com/outboxhq/outbox/brokers/kafka"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
)

func TestMain(m *testing.M) {
	code := m.Run()
	// Links torn down as a test ends close aside, each bounded by the
	// publisher's close timeout; on a loaded machine that outlasts goleak's
	// own short retries, so wait that long before calling a goroutine leaked.
	deadline := time.Now().Add(10 * time.Second)
	for code == 0 {
		err := goleak.Find(
			// Sarama's metrics registry starts a ticker goroutine per meter it
			// never stops (rcrowley/go-metrics).
			goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
			// A producer whose broker failed opens a circuit breaker whose
			// timer sleeps out 10s after the producer is closed.
			goleak.IgnoreAnyFunction("github.com/eapache/go-resiliency/breaker.(*Breaker).timer"),
		)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
		time.Sleep(100 * time.Millisecond)
	}
	os.Exit(code)
}

// cluster starts an in-process Kafka on loopback, closed when the test ends.
func cluster(t testing.TB, opts ...kfake.Opt) *kfake.Cluster {
	t.Helper()
	opts = append([]kfake.Opt{kfake.NumBrokers(1), kfake.AllowAutoTopicCreation(), kfake.DefaultNumPartitions(4)}, opts...)
	c, err := kfake.NewCluster(opts...)
	if err != nil {
		t.Fatalf("start kfake: %v", err)
	}
	t.Cleanup(c.Close)
	return c
}

// read consumes topic from its start until n records arrived.
func read(t *testing.T, addrs []string, topic string, n int) []brokertest.Received {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	var got []brokertest.Received
	for len(got) < n {
		f := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("topic %s: %d records, want %d", topic, len(got), n)
		}
		f.EachRecord(func(r *kgo.Record) { got = append(got, received(r)) })
	}
	return got[:n]
}

func received(r *kgo.Record) brokertest.Received {
	h := map[string]string{}
	for _, kv := range r.Headers {
		h[kv.Key] = string(kv.Value)
	}
	return brokertest.Received{Key: string(r.Key), Headers: h, ContentType: h[event.HeaderContentType], Body: r.Value}
}

func TestConformance(t *testing.T) {
	var kf *kfake.Cluster
	brokertest.Run(t, brokertest.Harness{
		Open: func(t *testing.T, r *brokers.Routing, _ []string) core.Publisher {
			kf = cluster(t)
			pub, err := kafka.New(t.Context(), kafka.Config{Brokers: kf.ListenAddrs()}, r, nil)
			if err != nil {
				t.Fatal(err)
			}
			return pub
		},
		Read: func(t *testing.T, topic string, n int) []brokertest.Received {
			return read(t, kf.ListenAddrs(), topic, n)
		},
		Stop:        func(t *testing.T, _ core.Publisher) { kf.Close() },
		CloudEvents: kafka.CloudEventsBinding,
		Timeout:     20 * time.Second,
	})
}

func TestMessageTooLargeIsPermanent(t *testing.T) {
	kf := cluster(t, kfake.BrokerConfigs(map[string]string{"message.max.bytes": "2000"}))
	pub, err := kafka.New(t.Context(), kafka.Config{Brokers: kf.ListenAddrs()}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	e := &core.Event{Seq: 1, ID: "u1", AggregateID: "a", Type: "big.thing", Payload: bytes.Repeat([]byte("x"), 10000)}
	err = pub.Publish(t.Context(), e)
	if !core.IsPermanent(err) {
		t.Fatalf("publish of a message over the broker's limit: %v, want a permanent error", err)
	}
	// Past the client's own limit it never reaches the broker.
	e.Payload = bytes.Repeat([]byte("x"), 2_000_000)
	if err := pub.Publish(t.Context(), e); !core.IsPermanent(err) {
		t.Fatalf("publish over max_message_bytes: %v, want a permanent error", err)
	}
	e.Payload = []byte(`{}`)
	if err := pub.Publish(t.Context(), e); err != nil {
		t.Fatalf("small publish after a large one: %v", err)
	}
}

func TestUnreachableFailsAtStart(t *testing.T) {
	kf := cluster(t)
	addrs := kf.ListenAddrs()
	kf.Close()
	start := time.Now()
	_, err := kafka.New(t.Context(), kafka.Config{Brokers: addrs, DialTimeout: time.Second}, nil, nil)
	if err == nil {
		t.Fatal("New with no broker listening succeeded")
	}
	t.Logf("failed after %v: %v", time.Since(start).Round(time.Millisecond), err)
}

func TestSASL(t *testing.T) {
	for _, mech := range []string{"PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"} {
		t.Run(mech, func(t *testing.T) {
			kf := cluster(t, kfake.EnableSASL(), kfake.Superuser(mech, "relay", "s3cret-pw"))
			s := kafka.Config{Brokers: kf.ListenAddrs(), SASLMechanism: mech, SASLUser: "relay", SASLPassword: "s3cret-pw"}
			pub, err := kafka.New(t.Context(), s, nil, nil)
			if err != nil {
				t.Fatalf("connect with good credentials: %v", err)
			}
			if err := pub.Publish(t.Context(), &core.Event{Seq: 1, ID: "u", AggregateID: "a", Type: "t.x", Payload: []byte(`{}`)}); err != nil {
				t.Fatalf("publish: %v", err)
			}
			_ = pub.Close()

			var logs bytes.Buffer
			log := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
			s.SASLPassword = "wrong-pw-Zq9"
			s.DialTimeout = 2 * time.Second
			_, err = kafka.New(t.Context(), s, nil, log)
			if err == nil {
				t.Fatal("connect with a wrong password succeeded")
			}
			for _, out := range []string{err.Error(), logs.String(), s.String()} {
				if strings.Contains(out, "wrong-pw-Zq9") {
					t.Errorf("password leaked: %s", out)
				}
			}
		})
	}
}

func TestValidate(t *testing.T) {
	cases := []struct {
		s    kafka.Config
		want string
	}{
		{kafka.Config{}, "kafka: brokers is empty"},
		{kafka.Config{Brokers: []string{"nohost"}}, "kafka: brokers"},
		{kafka.Config{Brokers: []string{"h:1"}, Acks: "none"}, "kafka: acks"},
		{kafka.Config{Brokers: []string{"h:1"}, Compression: "brotli"}, "kafka: compression"},
		{kafka.Config{Brokers: []string{"h:1"}, Version: "banana"}, "kafka: version"},
		{kafka.Config{Brokers: []string{"h:1"}, SASLMechanism: "PLAIN"}, "kafka: sasl_user is empty"},
		{kafka.Config{Brokers: []string{"h:1"}, SASLMechanism: "PLAIN", SASLUser: "u"}, "kafka: sasl_password is empty"},
		{kafka.Config{Brokers: []string{"h:1"}, SASLMechanism: "GSSAPI"}, "kafka: sasl_mechanism"},
		{kafka.Config{Brokers: []string{"h:1"}, SASLUser: "u"}, "kafka: sasl_mechanism is empty"},
		{kafka.Config{Brokers: []string{"h:1"}, Timeout: -time.Second}, "kafka: timeout"},
		{kafka.Config{Brokers: []string{"h:1"}, Partitioner: "random"}, "kafka: partitioner"},
	}
	for _, c := range cases {
		err := c.s.Validate()
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Validate(%+v) = %v, want %q", c.s, err, c.want)
		}
	}
	if err := (kafka.Config{Brokers: []string{"h:1"}}).Validate(); err != nil {
		t.Errorf("minimal settings: %v", err)
	}
	_, err := kafka.New(t.Context(), kafka.Config{Brokers: []string{"h:1"}, TLSCAFile: "/nonexistent/ca.pem"}, nil, nil)
	if err == nil || !strings.Contains(err.Error(), "tls_ca_file") {
		t.Errorf("missing CA file: %v, want an error naming tls_ca_file", err)
	}
}

func TestRegistered(t *testing.T) {
	kf := cluster(t)
	cfg := brokers.DecoderFunc(func(v any) error {
		*(v.(*kafka.Config)) = kafka.Config{Brokers: kf.ListenAddrs()}
		return nil
	})
	pub, err := brokers.Open(t.Context(), "kafka", brokers.Options{Config: cfg})
	if err != nil {
		t.Fatal(err)
	}
	_ = pub.Close()
}

// proxied starts kfake behind a proxy: the cluster advertises the proxy's
// address, so every connection the client makes, bootstrap and brokers,
// passes through it.
func proxied(t *testing.T) (*kfake.Cluster, *brokertest.Proxy) {
	t.Helper()
	var proxy *brokertest.Proxy
	kf := cluster(t, kfake.ListenFn(func(network, addr string) (net.Listener, error) {
		ln, err := net.Listen(network, "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		proxy = brokertest.NewProxy(t, ln.Addr().String())
		return proxy.Advertise(ln), nil
	}))
	return kf, proxy
}

func TestStalls(t *testing.T) {
	brokertest.RunStalls(t, brokertest.StallHarness{
		Open: func(t *testing.T, r *brokers.Routing, _ []string) (core.Publisher, *brokertest.Proxy) {
			kf, proxy := proxied(t)
			pub, err := kafka.New(t.Context(), kafka.Config{Brokers: kf.ListenAddrs(), DialTimeout: 2 * time.Second, Timeout: time.Second}, r, brokertest.Logger(t))
			if err != nil {
				t.Fatal(err)
			}
			return pub, proxy
		},
		// A black hole looks the same to the client as a stall until the
		// heal; the amqp suite runs all three.
		Modes: []brokertest.Mode{brokertest.Stall, brokertest.HalfOpen},
	})
}

// A broker address that accepts connections and never answers fails
// start-up within dial_timeout, not after Sarama's read timeouts and
// retries (minutes).
func TestStartUpBoundedByDialTimeout(t *testing.T) {
	for _, m := range []brokertest.Mode{brokertest.BlackHole, brokertest.HalfOpen} {
		t.Run(m.String(), func(t *testing.T) {
			kf, proxy := proxied(t)
			proxy.SetMode(m)
			start := time.Now()
			_, err := kafka.New(t.Context(), kafka.Config{Brokers: kf.ListenAddrs(), DialTimeout: time.Second}, nil, nil)
			took := time.Since(start)
			if err == nil {
				t.Fatal("New against a broker that never answers succeeded")
			}
			t.Logf("failed after %v: %v", took.Round(time.Millisecond), err)
			if took > 1500*time.Millisecond {
				t.Fatalf("New took %v with dial_timeout 1s", took)
			}
		})
	}
}
