package googlecloud_test

import (
	"bytes"
	"strings"
	"testing"
	"time"

	//lint:ignore SA1019 watermill-googlecloud v1.2.1 is built on pubsub v1, whose types it takes
	"cloud.google.com/go/pubsub/apiv1/pubsubpb"
	"cloud.google.com/go/pubsub/pstest"
	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/brokertest"
	"github.com/outboxhq/outbox/brokers/googlecloud"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// OpenCensus starts its metrics worker at init and never stops it.
		goleak.IgnoreTopFunction("go.opencensus.io/stats/view.(*worker).start"),
	)
}

const project = "outbox-test"

// server starts an in-process Pub/Sub fake on loopback, reached through the
// emulator_host setting as Google's emulator would be.
func server(t testing.TB) *pstest.Server {
	srv := pstest.NewServer()
	t.Cleanup(func() { _ = srv.Close() })
	return srv
}

func read(t *testing.T, srv *pstest.Server, topic string, n int) []brokertest.Received {
	t.Helper()
	name := "projects/" + project + "/topics/" + topic
	deadline := time.Now().Add(10 * time.Second)
	for {
		var got []brokertest.Received
		for _, m := range srv.Messages() { // in publish order
			if m.Topic == name {
				got = append(got, brokertest.Received{Key: m.OrderingKey, Headers: m.Attributes, ContentType: m.Attributes[event.HeaderContentType], Body: m.Data})
			}
		}
		if len(got) >= n {
			return got[:n]
		}
		if time.Now().After(deadline) {
			t.Fatalf("topic %s: %d messages, want %d", topic, len(got), n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestConformance(t *testing.T) {
	var srv *pstest.Server
	brokertest.Run(t, brokertest.Harness{
		Open: func(t *testing.T, r *brokers.Routing, _ []string) core.Publisher {
			srv = server(t)
			pub, err := googlecloud.New(t.Context(), googlecloud.Config{
				ProjectID: project, EmulatorHost: srv.Addr, CreateTopics: true, PublishTimeout: 3 * time.Second,
			}, r, nil)
			if err != nil {
				t.Fatal(err)
			}
			return pub
		},
		Read:        func(t *testing.T, topic string, n int) []brokertest.Received { return read(t, srv, topic, n) },
		Stop:        func(t *testing.T, _ core.Publisher) { _ = srv.Close() },
		CloudEvents: googlecloud.CloudEventsBinding,
		Timeout:     20 * time.Second,
	})
}

func TestPermanentErrorsAndResume(t *testing.T) {
	srv := server(t)
	pub, err := googlecloud.New(t.Context(), googlecloud.Config{ProjectID: project, EmulatorHost: srv.Addr, CreateTopics: true},
		&brokers.Routing{Fixed: "refusals"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	e := &core.Event{Seq: 1, ID: "u1", AggregateID: "agg", Type: "t.x", Payload: []byte(`{}`)}
	srv.SetAutoPublishResponse(false)
	srv.AddPublishResponse(nil, status.Error(codes.InvalidArgument, "refused"))
	if err := pub.Publish(t.Context(), e); !core.IsPermanent(err) {
		t.Fatalf("publish the service refuses as invalid: %v, want a permanent error", err)
	}
	// The failure paused the ordering key; the publisher resumes it.
	//lint:ignore SA1019 pstest of pubsub v1 takes the v1 type
	srv.AddPublishResponse(&pubsubpb.PublishResponse{MessageIds: []string{"m2"}}, nil)
	e.Seq = 2
	if err := pub.Publish(t.Context(), e); err != nil {
		t.Fatalf("publish on the same key after a failure: %v", err)
	}
	srv.SetAutoPublishResponse(true)
	e.Payload = bytes.Repeat([]byte("x"), 11e6) // over the 10MB request limit
	if err := pub.Publish(t.Context(), e); !core.IsPermanent(err) {
		t.Fatalf("publish of an oversized message: %v, want a permanent error", err)
	}
}

func TestMissingTopicIsPermanent(t *testing.T) {
	srv := server(t)
	pub, err := googlecloud.New(t.Context(), googlecloud.Config{ProjectID: project, EmulatorHost: srv.Addr}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	err = pub.Publish(t.Context(), &core.Event{Seq: 1, ID: "u", AggregateID: "a", Type: "absent.x", Payload: []byte(`{}`)})
	if !core.IsPermanent(err) || !strings.Contains(err.Error(), "absent") {
		t.Fatalf("publish to a missing topic: %v, want a permanent error naming it", err)
	}
}

func TestValidate(t *testing.T) {
	cases := []struct {
		s    googlecloud.Config
		want string
	}{
		{googlecloud.Config{}, "googlecloud: project_id is empty"},
		{googlecloud.Config{ProjectID: "p", EmulatorHost: "h:1", CredentialsFile: "f"}, "emulator_host and credentials_file"},
		{googlecloud.Config{ProjectID: "p", DelayThreshold: -1}, "googlecloud: delay_threshold"},
		{googlecloud.Config{ProjectID: "p", CountThreshold: -1}, "googlecloud: count_threshold"},
	}
	for _, c := range cases {
		if err := c.s.Validate(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Validate(%+v) = %v, want %q", c.s, err, c.want)
		}
	}
}

func TestRegistered(t *testing.T) {
	srv := server(t)
	cfg := brokers.DecoderFunc(func(v any) error {
		*(v.(*googlecloud.Config)) = googlecloud.Config{ProjectID: project, EmulatorHost: srv.Addr}
		return nil
	})
	pub, err := brokers.Open(t.Context(), "googlecloud", brokers.Options{Config: cfg})
	if err != nil {
		t.Fatal(err)
	}
	_ = pub.Close()
}

func TestStalls(t *testing.T) {
	brokertest.RunStalls(t, brokertest.StallHarness{
		Open: func(t *testing.T, r *brokers.Routing, _ []string) (core.Publisher, *brokertest.Proxy) {
			srv := server(t)
			proxy := brokertest.NewProxy(t, srv.Addr)
			pub, err := googlecloud.New(t.Context(), googlecloud.Config{
				ProjectID: project, EmulatorHost: proxy.Addr(), CreateTopics: true, PublishTimeout: 3 * time.Second,
			}, r, brokertest.Logger(t))
			if err != nil {
				t.Fatal(err)
			}
			return pub, proxy
		},
		Modes: []brokertest.Mode{brokertest.BlackHole, brokertest.HalfOpen},
	})
}
