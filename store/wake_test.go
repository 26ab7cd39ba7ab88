package store_test

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
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/pgtest"
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
	stores := make([]*store.Store, n)
	for i := range relays {
		s, err := store.New(pgtest.NewPool(t), cfg, nil)
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
			if o := s.Owned(); len(o) >= store.Partitions/n {
				owned += len(o)
			}
		}
		if owned == store.Partitions {
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

// trickle writes events one per transaction on aggregates spread over
// the partitions, from producers writers, each writing burst events back
// to back and then pausing, until ctx is done. Each transaction works a
// few milliseconds after its INSERT, as a service's does, so relays go to
// sleep while producers' transactions are open. Traffic that comes in
// bursts has commits that land while the relays are busy with the burst's
// first events, and quiet after them: a wake-up lost then is not covered
// by the next event's.
func trickle(ctx context.Context, t *testing.T, pool *pgxpool.Pool, table string, producers, burst int, pause time.Duration) []produced {
	t.Helper()
	var mu sync.Mutex
	var out []produced
	var wg sync.WaitGroup
	for range producers {
		wg.Go(func() {
			for {
				for range burst {
					var seq int64
					err := pgx.BeginFunc(context.Background(), pool, func(tx pgx.Tx) error {
						err := tx.QueryRow(context.Background(), "INSERT INTO "+table+
							" (aggregate_id, type, payload) VALUES ($1, 't.x', '{}') RETURNING seq",
							strconv.FormatUint(rand.Uint64(), 36)).Scan(&seq)
						if err != nil {
							return err
						}
						_, err = tx.Exec(context.Background(), "SELECT pg_sleep(0.01)")
						return err
					})
					if err != nil {
						t.Errorf("produce: %v", err)
						return
					}
					mu.Lock()
					out = append(out, produced{seq: seq, committed: time.Now()})
					mu.Unlock()
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

// Three relays share the partitions while producers write a trickle, one
// event per transaction: every event goes out promptly, whichever relay
// owns its partition and whichever relay producers last woke. A lost
// wake-up would leave an event waiting for its relay's poll interval.
func TestEveryRelayWakesAtATrickle(t *testing.T) {
	pool, cfg := pgtest.SchemaWith(t, store.Config{NotifyChannel: uniqueChannel()})
	pub := newTimedPublisher()
	wakeRelays(t, cfg, 3, pub)
	table := cfg.Schema + ".events_outbox"
	// Three producers in bursts of five, with pauses of about a second:
	// about 15 events a second.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	events := trickle(ctx, t, pool, table, 8, 3, time.Second)
	lat := latencies(t, pub, events)
	t.Logf("commit to publish, 3 relays: %s", describe(lat))
	if slow := lat[len(lat)-1]; slow > wakeWithin {
		n := len(lat) - slices.IndexFunc(lat, func(d time.Duration) bool { return d > wakeWithin })
		t.Errorf("%d of %d events waited over %s for a relay (the slowest %s; poll interval %s)", n, len(lat), wakeWithin, slow, wakePoll)
	}
}

// A producer transaction that wrote an event and stays open for seconds
// does not hold the relays back: other producers' events go out
// promptly, a relay asked to stop returns at once, and the open
// transaction's event goes out promptly once it commits.
func TestLongProducerTransactionBesideRelays(t *testing.T) {
	pool, cfg := pgtest.SchemaWith(t, store.Config{NotifyChannel: uniqueChannel()})
	pub := newTimedPublisher()
	relays := wakeRelays(t, cfg, 3, pub)
	table := cfg.Schema + ".events_outbox"
	ctx := context.Background()

	long, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer long.Rollback(ctx)
	var longSeq int64
	if err := long.QueryRow(ctx, "INSERT INTO "+table+" (aggregate_id, type, payload) VALUES ('long', 't.x', '{}') RETURNING seq").
		Scan(&longSeq); err != nil {
		t.Fatal(err)
	}
	tctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	events := trickle(tctx, t, pool, table, 8, 3, time.Second)
	lat := latencies(t, pub, events)
	t.Logf("commit to publish beside an open producer transaction: %s", describe(lat))
	if slow := lat[len(lat)-1]; slow > wakeWithin {
		t.Errorf("beside an open producer transaction, an event waited %s for a relay (poll interval %s)", slow, wakePoll)
	}

	start := time.Now()
	if err := relays[0].Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took > time.Second {
		t.Errorf("a relay took %s to stop beside an open producer transaction (poll interval %s)", took, wakePoll)
	}

	if err := long.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	lat = latencies(t, pub, []produced{{seq: longSeq, committed: time.Now()}})
	t.Logf("the long transaction's event went out %s after its commit", lat[0])
	if lat[0] > wakeWithin {
		t.Errorf("the long transaction's event went out %s after its commit (poll interval %s)", lat[0], wakePoll)
	}
}
