package outboxcli

import (
	"context"
	"net"
	"net/http"
	"testing"
	"time"

	"cloud.google.com/go/pubsub/pstest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kfake"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/brokertest"
	"github.com/outboxhq/outbox/brokers/googlecloud"
	"github.com/outboxhq/outbox/brokers/kafka"
	"github.com/outboxhq/outbox/brokers/tracing"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/memsource"
)

// /readyz asks the broker for every adapter, through the tracing wrapper:
// ready while it answers, 503 naming the broker while it does not, ready
// again once it answers.
func TestReadyzChecksBroker(t *testing.T) {
	cases := []struct {
		name string
		open func(t *testing.T) (core.Publisher, *brokertest.Proxy)
	}{
		{"kafka", func(t *testing.T) (core.Publisher, *brokertest.Proxy) {
			// kfake advertises the proxy's address, so every connection
			// goes through it.
			var proxy *brokertest.Proxy
			kf, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.AllowAutoTopicCreation(),
				kfake.ListenFn(func(network, addr string) (net.Listener, error) {
					ln, err := net.Listen(network, addr)
					if err != nil {
						return nil, err
					}
					proxy = brokertest.NewProxy(t, ln.Addr().String())
					return proxy.Advertise(ln), nil
				}))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(kf.Close)
			pub, err := kafka.New(t.Context(), kafka.Config{Brokers: kf.ListenAddrs(), DialTimeout: 2 * time.Second}, nil, nil)
			if err != nil {
				t.Fatal(err)
			}
			return pub, proxy
		}},
		{"googlecloud", func(t *testing.T) (core.Publisher, *brokertest.Proxy) {
			srv := pstest.NewServer()
			t.Cleanup(func() { _ = srv.Close() })
			proxy := brokertest.NewProxy(t, srv.Addr)
			pub, err := googlecloud.New(t.Context(), googlecloud.Config{ProjectID: "p", EmulatorHost: proxy.Addr()}, &brokers.Routing{}, nil)
			if err != nil {
				t.Fatal(err)
			}
			return pub, proxy
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			pub, proxy := c.open(t)
			defer pub.Close()
			traced, err := tracing.Wrap(pub, tracing.Options{TracerProvider: noop.NewTracerProvider()})
			if err != nil {
				t.Fatal(err)
			}
			r, err := core.New(memsource.New(), traced, core.Options{})
			if err != nil {
				t.Fatal(err)
			}
			if err := r.Start(t.Context()); err != nil {
				t.Fatal(err)
			}
			defer r.Stop(context.Background())
			h := opsHandler(prometheus.NewRegistry(), r.Ready, discardLogger())
			if code, res := getReady(t, h); code != http.StatusOK || res["publisher"] != "ok" {
				t.Fatalf("readyz with the broker up = %d %v, want 200 with a publisher check", code, res)
			}
			proxy.SetMode(brokertest.BlackHole)
			if code, res := getReady(t, h); code != http.StatusServiceUnavailable || res["publisher"] == "ok" || res["publisher"] == "" {
				t.Fatalf("readyz with the broker black-holed = %d %v, want 503 naming the publisher", code, res)
			}
			proxy.Heal()
			deadline := time.Now().Add(10 * time.Second)
			for {
				code, res := getReady(t, h)
				if code == http.StatusOK {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("readyz 10s after the broker healed = %d %v", code, res)
				}
				time.Sleep(100 * time.Millisecond)
			}
		})
	}
}
