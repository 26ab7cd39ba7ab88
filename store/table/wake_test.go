package table_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
	tablesrc "github.com/outboxhq/outbox/store/table"
)

// wakePoll is the poll interval of the wake-up tests' relays: an event
// whose wake-up is lost waits most of it, far above wakeWithin.
const (
	wakePoll   = 3 * time.Second
	wakeWithin = 500 * time.Millisecond
)

// timedPublisher records when each event, by seq, was first published.
type timedPublisher struct {
	mu  sync.Mutex
	at  map[int64]time.Time
	got chan struct{}
}

func newTimedPublisher() *timedPublisher {
	return &timedPublisher{at: map[int64]time.Time{}, got: make(chan struct{}, 1)}
}

func (p *timedPublisher) Publish(_ context.Context, e *core.Event) error {
	p.mu.Lock()
	if _, ok := p.at[e.Seq]; !ok {
		p.at[e.Seq] = time.Now()
	}
	p.mu.Unlock()
	select {
	case p.got <- struct{}{}:
	default:
	}
	return nil
}

func (p *timedPublisher) Close() error { return nil }

func (p *timedPublisher) published(seq int64) (time.Time, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	at, ok := p.at[seq]
	return at, ok
}

// wakeRelays runs n relays on the table of cfg, each on a Store and a
// pool of its own as separate processes would, sharing the partitions,
// and waits until they have split them.
func wakeRelays(t *testing.T, cfg store.Config, n int, pub core.Publisher) []*core.Relay {
	t.Helper()
	cfg.ShareInterval = 100 * time.Millisecond
	relays := make([]*core.Relay, n)
	stores := make([]*tablesrc.Source, n)
	for i := range relays {
		s, err := tablesrc.New(pgtest.NewPool(t), cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		r, err := core.New(s, pub, core.Options{PollInterval: wakePoll})
		if err != nil {
			t.Fatal(err)
		}
		if err := r.Start(context.Background()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = r.Stop(context.Background()) })
		relays[i], stores[i] = r, s
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		owned := 0
		for _, s := range stores {
			if o := s.Owned(); len(o) >= tablesrc.Partitions/n {
				owned += len(o)
			}
		}
		if owned == tablesrc.Partitions {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the relays did not split the partitions within 10s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	return relays
}

// produced is an event's seq and when its producer's COMMIT returned.
type produced struct {
	seq       int64
	committed time.Time
}

// trickle writes events one per transaction, on aggregates spread over
// the partitions, until ctx is done: each of producers writes burst
// events in a row, then pauses for about pause. The last transaction of a
// burst works for work after its INSERT, as a service's does: it writes
// while the relays are busy with the burst, and commits after they went
// back to sleep, with nothing after it until the next burst. A wake-up
// lost then is not covered by the next event's.
func trickle(ctx context.Context, t *testing.T, pool *pgxpool.Pool, table string, producers, burst int, work, pause time.Duration) []produced {
	t.Helper()
	var mu sync.Mutex
	var out []produced
	write := func(work time.Duration) bool {
		var seq int64
		err := pgx.BeginFunc(context.Background(), pool, func(tx pgx.Tx) error {
			err := tx.QueryRow(context.Background(), "INSERT INTO "+table+
				" (aggregate_id, type, payload) VALUES ($1, 't.x', '{}') RETURNING seq",
				strconv.FormatUint(rand.Uint64(), 36)).Scan(&seq)
			if err != nil {
				return err
			}
			if work > 0 {
				_, err = tx.Exec(context.Background(), "SELECT pg_sleep($1)", work.Seconds())
			}
			return err
		})
		if err != nil {
			t.Errorf("produce: %v", err)
			return false
		}
		mu.Lock()
		out = append(out, produced{seq: seq, committed: time.Now()})
		mu.Unlock()
		return true
	}
	var wg sync.WaitGroup
	for range producers {
		wg.Go(func() {
			for {
				for i := range burst {
					w := time.Duration(0)
					if i == burst-1 {
						w = work
					}
					if !write(w) {
						return
					}
				}
				select {
				case <-ctx.Done():
					return
				case <-time.After(pause + rand.N(pause/4)):
				}
			}
		})
	}
	wg.Wait()
	return out
}

// latencies waits for every event to be published and returns each one's
// commit-to-publish latency, sorted.
func latencies(t *testing.T, pub *timedPublisher, events []produced) []time.Duration {
	t.Helper()
	deadline := time.Now().Add(2 * wakePoll)
	var lat []time.Duration
	for _, e := range events {
		for {
			at, ok := pub.published(e.seq)
			if ok {
				lat = append(lat, max(at.Sub(e.committed), 0))
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("event %d not published within %s", e.seq, 2*wakePoll)
			}
			select {
			case <-pub.got:
			case <-time.After(10 * time.Millisecond):
			}
		}
	}
	slices.Sort(lat)
	return lat
}

func describe(lat []time.Duration) string {
	if len(lat) == 0 {
		return "no events"
	}
	q := func(p float64) time.Duration { return lat[int(p*float64(len(lat)-1))].Round(100 * time.Microsecond) }
	return fmt.Sprintf("%d events: p50 %s, p99 %s, max %s", len(lat), q(0.5), q(0.99), q(1))
}

// uniqueChannel keeps the test's wake-ups to itself: other tests' producers
// notify the default channel, and their wake-ups would hide a lost one.
func uniqueChannel() string { return fmt.Sprintf("wake_%x", rand.Uint64()) }

// Three relays share the partitions while producers write a trickle in
// bursts, one event per transaction: every event goes out promptly,
// whichever relay owns its partition and whichever relay went to sleep
// first. A lost wake-up leaves an event waiting for its relay's poll.
func TestEveryRelayWakesAtATrickle(t *testing.T) {
	pool, cfg := pgtest.SchemaWith(t, store.Config{NotifyChannel: uniqueChannel()})
	pub := newTimedPublisher()
	wakeRelays(t, cfg, 3, pub)
	// Eight producers writing six events each about every second: about
	// 40 events a second, for 8 seconds.
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Second)
	defer cancel()
	events := trickle(ctx, t, pool, cfg.Schema+".events_outbox", 8, 6, 30*time.Millisecond, time.Second)
	lat := latencies(t, pub, events)
	t.Logf("commit to publish, 3 relays: %s", describe(lat))
	if slow := lat[len(lat)-1]; slow > wakeWithin {
		n := len(lat) - slices.IndexFunc(lat, func(d time.Duration) bool { return d > wakeWithin })
		t.Errorf("%d of %d events waited over %s for a relay (the slowest %s; poll interval %s)", n, len(lat), wakeWithin, slow, wakePoll)
	}
}

// A producer transaction that wrote while no relay slept, and stays open
// for seconds, holds no relay back: the relays sleep beside it, other
// producers' events go out promptly, a relay asked to stop returns at
// once, and once the transaction commits its events go out promptly,
// whichever relays own them. It writes one event on each partition, so
// that every relay owns some.
func TestLongProducerTransactionBesideRelays(t *testing.T) {
	pool, cfg := pgtest.SchemaWith(t, store.Config{NotifyChannel: uniqueChannel()})
	table := cfg.Schema + ".events_outbox"
	ctx := context.Background()
	long, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer long.Rollback(ctx)
	rows, err := long.Query(ctx, "INSERT INTO "+table+` (aggregate_id, type, payload)
SELECT DISTINCT ON (hashtext(k) & 31) k, 't.x', '{}' FROM (SELECT 'long-' || i AS k FROM generate_series(1, 1000) i) ks
RETURNING seq`)
	if err != nil {
		t.Fatal(err)
	}
	longSeqs, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	if len(longSeqs) != tablesrc.Partitions {
		t.Fatalf("the long transaction wrote %d events, want one per partition", len(longSeqs))
	}

	pub := newTimedPublisher()
	relays := wakeRelays(t, cfg, 3, pub)
	tctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	events := trickle(tctx, t, pool, table, 4, 3, 10*time.Millisecond, 500*time.Millisecond)
	lat := latencies(t, pub, events)
	t.Logf("commit to publish beside an open producer transaction: %s", describe(lat))
	if slow := lat[len(lat)-1]; slow > wakeWithin {
		t.Errorf("beside an open producer transaction, an event waited %s for a relay (poll interval %s)", slow, wakePoll)
	}

	start := time.Now()
	if err := relays[0].Stop(ctx); err != nil {
		t.Fatal(err)
	}
	took := time.Since(start)
	t.Logf("a relay stopped in %s beside the open transaction", took)
	if took > time.Second {
		t.Errorf("a relay took %s to stop beside an open producer transaction (poll interval %s)", took, wakePoll)
	}

	if err := long.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	committed := time.Now()
	var after []produced
	for _, seq := range longSeqs {
		after = append(after, produced{seq: seq, committed: committed})
	}
	lat = latencies(t, pub, after)
	t.Logf("the long transaction's events after its commit: %s", describe(lat))
	if slow := lat[len(lat)-1]; slow > wakeWithin {
		t.Errorf("the long transaction's events went out up to %s after its commit (poll interval %s)", slow, wakePoll)
	}
}
