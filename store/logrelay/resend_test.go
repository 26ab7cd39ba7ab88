package logrelay_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/outboxhq/outbox/core"
)

// A kill re-sends little: at a steady event rate (rows and log-only
// messages, 16 aggregates, a broker taking 2ms per event) the replication
// connection is dropped from the server's side (the walsender ends, as
// when the relay's process dies: nothing drained, no last status) four
// times, and the duplicates per kill are counted against the rate, with
// the default StatusInterval (1s) and MarkBatch. Confirming only with
// each status re-sent 0.5 to 0.65s of traffic per kill; confirming a
// moved position within 100ms, 0.03 to 0.05s. The bound, 0.2s, leaves
// the relay room to lag on a loaded machine.
func TestKillResendsLittle(t *testing.T) {
	e := newEnv(t)
	e.createSlot()
	pub := &recorder{fail: func(*core.Event) error { time.Sleep(2 * time.Millisecond); return nil }}
	o := e.opts()
	o.StatusInterval, o.ReceiveTimeout, o.Lanes = time.Second, 5*time.Second, 16
	e.start(pub, o)

	const rate = 300 // events per second, written by three producers
	aggs := make([]string, 16)
	for i := range aggs {
		aggs[i] = uuid.NewString()
	}
	stop := make(chan struct{})
	var written atomic.Int64
	var wg sync.WaitGroup
	for w := range 3 {
		wg.Go(func() {
			tick := time.NewTicker(time.Second / time.Duration(rate/3))
			defer tick.Stop()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				case <-tick.C:
				}
				e.write((i+w)%2 == 0, aggs[(i*3+w)%len(aggs)], i, 1)
				written.Add(1)
			}
		})
	}
	time.Sleep(2 * time.Second)
	const kills = 4
	var dupsAt []int
	for range kills {
		_, before := firstOrder(pub.events())
		if _, err := e.pool.Exec(context.Background(),
			"SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1 AND active", e.slot.Name); err != nil {
			t.Fatal(err)
		}
		time.Sleep(3 * time.Second)
		_, after := firstOrder(pub.events())
		dupsAt = append(dupsAt, after-before)
	}
	close(stop)
	wg.Wait()
	waitFor(t, 60*time.Second, "every event", func() bool { return int64(len(pub.distinct())) == written.Load() })
	_, dups := firstOrder(pub.events())
	perKill := float64(dups) / kills
	t.Logf("%d events at %d/s, %d kills: %d duplicates (%v per kill), %.0f per kill = %.2fs of traffic",
		written.Load(), rate, kills, dups, dupsAt, perKill, perKill/rate)
	if perKill > 0.2*rate {
		t.Errorf("a kill re-sent %.0f events on average, %.2fs of traffic; want at most 0.2s", perKill, perKill/rate)
	}
}
