package kafka_test

import (
	"context"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/brokertest"
	"github.com/outboxhq/outbox/brokers/kafka"
	"github.com/outboxhq/outbox/core"
)

// txCluster is kfake for the exactly-once publisher.
func txCluster(t testing.TB) *kfake.Cluster {
	return cluster(t, kfake.NumBrokers(3))
}

func txConfig(kf *kfake.Cluster) kafka.Config {
	return kafka.Config{Brokers: kf.ListenAddrs(), ExactlyOnce: true, DialTimeout: 5 * time.Second, Timeout: 5 * time.Second}
}

func TestTxConformance(t *testing.T) {
	var kf *kfake.Cluster
	brokertest.Run(t, brokertest.Harness{
		Open: func(t *testing.T, r *brokers.Routing, _ []string) core.Publisher {
			kf = txCluster(t)
			pub, err := kafka.New(t.Context(), txConfig(kf), r, brokertest.Logger(t))
			if err != nil {
				t.Fatal(err)
			}
			if _, ok := pub.(core.Binder); !ok {
				t.Fatalf("exactly_once publisher %T is not a core.Binder", pub)
			}
			return pub
		},
		Read: func(t *testing.T, topic string, n int) []brokertest.Received {
			return readCommitted(t, kf.ListenAddrs(), topic, n)
		},
		Stop:        func(t *testing.T, _ core.Publisher) { kf.Close() },
		CloudEvents: kafka.CloudEventsBinding,
		Timeout:     20 * time.Second,
	})
}

// readCommitted is read with read_committed isolation.
func readCommitted(t *testing.T, addrs []string, topic string, n int) []brokertest.Received {
	t.Helper()
	var got []brokertest.Received
	for _, r := range consume(t, addrs, topic, n, kgo.ReadCommitted()) {
		got = append(got, received(r))
	}
	return got
}

// consume reads topic from its start until n records arrived.
func consume(t *testing.T, addrs []string, topic string, n int, level kgo.IsolationLevel) []*kgo.Record {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchIsolationLevel(level))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	var got []*kgo.Record
	for len(got) < n {
		f := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("topic %s: %d records, want %d", topic, len(got), n)
		}
		f.EachRecord(func(r *kgo.Record) { got = append(got, r) })
	}
	return got[:n]
}
