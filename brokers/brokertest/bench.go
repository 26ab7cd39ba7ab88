package brokertest

import (
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outboxhq/outbox/core"
)

// Lanes is the number of concurrent publishers the benchmarks run, the
// relay's default.
const Lanes = 16

// Bench publishes b.N events of type "bench.event" (topic "bench" with the
// default routing) from Lanes goroutines, each its own aggregate, as the
// relay's lanes would, and reports msg/s.
func Bench(b *testing.B, pub core.Publisher) {
	BenchFunc(b, func(lane int, seq int64) error {
		e := &core.Event{
			Seq: seq, ID: fmt.Sprintf("00000000-0000-4000-8000-%012d", seq), AggregateID: fmt.Sprintf("lane-%d", lane),
			Type: "bench.event", Payload: []byte(`{"order_id":"o-1","amount_cents":1299,"currency":"EUR"}`),
		}
		return pub.Publish(b.Context(), e)
	})
}

// BenchFunc runs publish from Lanes goroutines b.N times in all and reports
// msg/s; it is for comparing an adapter with the client it wraps.
func BenchFunc(b *testing.B, publish func(lane int, seq int64) error) {
	var lane, seq atomic.Int64
	b.SetParallelism((Lanes + 1) / 2) // times GOMAXPROCS; 16 lanes on 2 cores
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		l := int(lane.Add(1))
		for pb.Next() {
			if err := publish(l, seq.Add(1)); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "msg/s")
}
