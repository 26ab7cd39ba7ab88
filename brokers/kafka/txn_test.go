package kafka_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/brokertest"
	"github.com/outboxhq/outbox/brokers/kafka"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/memsource"
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

func TestTxBindRefuses(t *testing.T) {
	kf := txCluster(t)
	p := newTx(t, kf)
	if _, err := p.Bind(struct{ core.Source }{memsource.New()}); err == nil || !strings.Contains(err.Error(), "core.Settler") {
		t.Errorf("Bind of a source without units: %v, want an error naming core.Settler", err)
	}
	if err := p.Publish(t.Context(), ev(1, "a", 0)); err == nil {
		t.Error("the unbound publisher published")
	}
	adm := kadm.NewClient(mustClient(t, kf))
	if _, err := adm.CreateTopic(t.Context(), 2, 1, nil, "outbox.progress.small"); err != nil {
		t.Fatal(err)
	}
	_, err := p.Bind(brokertest.NewSettler("small", 4))
	if err == nil || !strings.Contains(err.Error(), "has 2 partitions, needs 4") {
		t.Errorf("Bind with a progress topic of too few partitions: %v", err)
	}
	// A name with characters Kafka refuses is made valid.
	b, err := p.Bind(brokertest.NewSettler(`"odd schema".outbox`, 2))
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Publish(t.Context(), ev(1, "a", 1)); err != nil {
		t.Fatal(err)
	}
	if got := consume(t, kf.ListenAddrs(), "outbox.progress._odd_schema_.outbox", 1, kgo.ReadCommitted()); got[0].Partition != 1 || string(got[0].Key) != "1" {
		t.Errorf("progress record in partition %d with key %q, want partition 1, key 1", got[0].Partition, got[0].Key)
	}
	if err := b.Publish(t.Context(), ev(2, "a", 2)); !core.IsPermanent(err) {
		t.Errorf("an event of unit 2 of 2 units: %v, want a permanent error", err)
	}
}

func mustClient(t *testing.T, kf *kfake.Cluster) *kgo.Client {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(kf.ListenAddrs()...))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	return cl
}

func TestTxValidate(t *testing.T) {
	h := []string{"h:1"}
	for _, c := range []struct {
		s    kafka.Config
		want string
	}{
		{kafka.Config{Brokers: h, ExactlyOnce: true, Acks: "leader"}, "kafka: exactly_once needs acks all"},
		{kafka.Config{Brokers: h, TransactionTimeout: 500 * time.Millisecond}, "kafka: transaction_timeout"},
		{kafka.Config{Brokers: h, TransactionTimeout: 16 * time.Minute}, "kafka: transaction_timeout"},
		{kafka.Config{Brokers: h, TransactionalIDPrefix: "a b"}, "kafka: transactional_id_prefix"},
		{kafka.Config{Brokers: h, ProgressTopicPrefix: "p/q"}, "kafka: progress_topic_prefix"},
	} {
		if err := c.s.Validate(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Validate(%+v) = %v, want %q", c.s, err, c.want)
		}
	}
	if err := (kafka.Config{Brokers: h, ExactlyOnce: true}).Validate(); err != nil {
		t.Errorf("exactly_once with the defaults: %v", err)
	}
}
