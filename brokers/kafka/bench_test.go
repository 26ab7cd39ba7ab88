package kafka_test

import (
	"fmt"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	wmkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/brokertest"
	"github.com/outboxhq/outbox/brokers/kafka"
	"github.com/outboxhq/outbox/brokers/wm"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
)

func BenchmarkPublish(b *testing.B) {
	kf := cluster(b)
	b.Run("adapter", func(b *testing.B) {
		pub, err := kafka.New(b.Context(), kafka.Config{Brokers: kf.ListenAddrs()}, nil, nil)
		if err != nil {
			b.Fatal(err)
		}
		defer pub.Close()
		brokertest.Bench(b, pub)
	})
	// The Watermill publisher alone, with the same producer settings.
	b.Run("watermill", func(b *testing.B) {
		cfg := wmkafka.DefaultSaramaSyncPublisherConfig()
		cfg.Producer.RequiredAcks = sarama.WaitForAll
		cfg.Producer.Idempotent = true
		cfg.Net.MaxOpenRequests = 1
		cfg.Version = sarama.DefaultVersion
		pub, err := wmkafka.NewPublisher(wmkafka.PublisherConfig{
			Brokers: kf.ListenAddrs(), OverwriteSaramaConfig: cfg,
			Marshaler: wmkafka.NewWithPartitioningMarshaler(func(_ string, m *message.Message) (string, error) {
				return m.Metadata.Get(event.HeaderAggregateID), nil
			}),
		}, nil)
		if err != nil {
			b.Fatal(err)
		}
		defer pub.Close()
		brokertest.BenchFunc(b, func(lane int, seq int64) error {
			return pub.Publish("bench", wm.NewMessage(benchEvent(lane, seq)))
		})
	})
}

func benchEvent(lane int, seq int64) *core.Event {
	return &core.Event{Seq: seq, ID: "00000000-0000-4000-8000-000000000000", AggregateID: "lane-" + string(rune('a'+lane)),
		Type: "bench.event", Payload: []byte(`{"order_id":"o-1","amount_cents":1299,"currency":"EUR"}`)}
}

// BenchmarkExactlyOnce compares the plain and the exactly-once publisher
// into one kfake cluster: 256 concurrent publishers, each its own
// aggregate, over a source of 32 units, and then 1,000 events/s paced.
// It reports msg/s and the publish latency's p50 and p99.
func BenchmarkExactlyOnce(b *testing.B) {
	kf := cluster(b, kfake.NumBrokers(3))
	plain, err := kafka.New(b.Context(), kafka.Config{Brokers: kf.ListenAddrs()}, &brokers.Routing{TopicPrefix: "plain-"}, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer plain.Close()
	tx, err := kafka.NewTx(b.Context(), kafka.Config{Brokers: kf.ListenAddrs(), ExactlyOnce: true}, &brokers.Routing{TopicPrefix: "tx-"}, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer tx.Close()
	src := brokertest.NewSettler("public.outbox", 32)
	bound, err := tx.Bind(src)
	if err != nil {
		b.Fatal(err)
	}
	for _, c := range []struct {
		name string
		pub  core.Publisher
	}{{"plain", plain}, {"exactly_once", bound}} {
		b.Run(c.name, func(b *testing.B) {
			const publishers = 256
			var lane, seq atomic.Int64
			var mu sync.Mutex
			var lat []time.Duration
			b.SetParallelism(publishers / runtime.GOMAXPROCS(0))
			start := time.Now()
			b.RunParallel(func(pb *testing.PB) {
				agg := "agg-" + strconv.FormatInt(lane.Add(1), 10)
				unit := src.Unit(agg)
				var mine []time.Duration
				for pb.Next() {
					s := seq.Add(1)
					e := &core.Event{Seq: s, ID: fmt.Sprintf("00000000-0000-4000-8000-%012d", s), AggregateID: agg, Unit: unit,
						Type: "bench.event", Payload: []byte(`{"order_id":"o-1","amount_cents":1299,"currency":"EUR"}`)}
					t0 := time.Now()
					if err := c.pub.Publish(b.Context(), e); err != nil {
						b.Error(err)
						return
					}
					mine = append(mine, time.Since(t0))
					src.Settle(e.ID) // as the relay records it
				}
				mu.Lock()
				lat = append(lat, mine...)
				mu.Unlock()
			})
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "msg/s")
			slices.Sort(lat)
			if len(lat) > 0 {
				b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50_ms")
				b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "p99_ms")
			}
		})
		b.Run(c.name+"/paced_1000_per_s", func(b *testing.B) {
			// Three seconds of 1,000 events/s, from 256 aggregates, whatever
			// b.N: a paced run measures latency, not throughput.
			var wg sync.WaitGroup
			var mu sync.Mutex
			var lat []time.Duration
			tick := time.NewTicker(time.Millisecond)
			defer tick.Stop()
			base := int64(10_000_000 * (len(c.name) + 1))
			for i := range 3000 {
				<-tick.C
				wg.Add(1)
				go func() {
					defer wg.Done()
					s := base + int64(i)
					agg := "paced-" + strconv.Itoa(i%256)
					e := &core.Event{Seq: s, ID: fmt.Sprintf("00000000-0000-4000-8000-%012d", s), AggregateID: agg, Unit: src.Unit(agg),
						Type: "bench.event", Payload: []byte(`{"order_id":"o-1","amount_cents":1299,"currency":"EUR"}`)}
					t0 := time.Now()
					if err := c.pub.Publish(b.Context(), e); err != nil {
						b.Error(err)
						return
					}
					d := time.Since(t0)
					src.Settle(e.ID)
					mu.Lock()
					lat = append(lat, d)
					mu.Unlock()
				}()
			}
			wg.Wait()
			slices.Sort(lat)
			if len(lat) > 0 {
				b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50_ms")
				b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "p99_ms")
			}
		})
	}
}
