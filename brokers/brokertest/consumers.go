package brokertest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
	"github.com/outboxhq/outbox/dedupe"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/admin"
	"github.com/outboxhq/outbox/store/table"
)

// ConsumerHarness connects RunConsumers to one broker: the relay's
// publisher adapter and the subscriber docs/consumers.md builds for it.
type ConsumerHarness struct {
	// Publisher opens the adapter as the relay runs it, routing with r.
	// The suite closes it.
	Publisher func(t *testing.T, r *brokers.Routing) core.Publisher
	// Subscriber opens the subscriber of one consuming service, built
	// with the adapter's SubscriberConfig. Its router closes it.
	Subscriber func(t *testing.T, service string) message.Subscriber
	// Timeout bounds each wait; default 30s. A whole run takes 2-6s under
	// -race on two cores, so the bound leaves room for a loaded machine.
	Timeout time.Duration
}

// The consumers' workload: aggregates x events, written interleaved so
// that every claim mixes aggregates.
const (
	consumerAggregates = 4
	consumerEvents     = 10
)

// consumerServices consume every event each. The first fails once on one
// event, which the broker then redelivers.
var consumerServices = []string{"billing", "shipping"}

var errInjected = errors.New("injected failure, to be redelivered")

// RunConsumers checks the consumer side end to end on a real PostgreSQL
// (internal/pgtest): events written with outbox.Writer are relayed by the
// core relay through the adapter; two services, each with its own
// subscriber and a dedupe.Deduper named after it, take every event once,
// in order per aggregate. Redeliveries come from a handler that fails
// once (the broker redelivers the nacked message) and from an operator's
// replay of one aggregate's events (the relay publishes them again): the
// dedupe middleware absorbs both.
func RunConsumers(t *testing.T, h ConsumerHarness) {
	t.Helper()
	if h.Publisher == nil || h.Subscriber == nil {
		t.Fatal("brokertest: ConsumerHarness needs Publisher and Subscriber")
	}
	if h.Timeout == 0 {
		h.Timeout = 30 * time.Second
	}
	ctx := t.Context()
	pool, cfg := pgtest.Schema(t)
	cfg, err := cfg.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	applied := pgx.Identifier{cfg.Schema, "applied"}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE TABLE `+applied+` (
    id bigserial PRIMARY KEY, service text NOT NULL, aggregate text NOT NULL, n int NOT NULL)`); err != nil {
		t.Fatalf("create applied table: %v", err)
	}
	topic := "consumers-" + uniquePrefix()[2:12]
	aggs := make([]string, consumerAggregates)
	for i := range aggs {
		aggs[i] = fmt.Sprintf("acct-%d", i)
	}

	// Services subscribe first: a queue or subscription created after an
	// event was published never gets it.
	counts := map[string]*deliveries{}
	for i, svc := range consumerServices {
		c := &deliveries{}
		counts[svc] = c
		failOn := ""
		if i == 0 {
			failOn = aggs[0] + "/3"
		}
		startConsumer(t, h, pool, cfg, svc, topic, applied, c, failOn)
	}

	start := time.Now()
	w, err := outbox.NewWriter(outbox.WriterOptions{Store: cfg})
	if err != nil {
		t.Fatal(err)
	}
	for n := 1; n <= consumerEvents; n++ {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			msgs := make([]outbox.Message, 0, len(aggs))
			for _, a := range aggs {
				msgs = append(msgs, outbox.Message{AggregateID: a, Type: "account.changed", Payload: map[string]int{"n": n}})
			}
			return w.Write(ctx, tx, msgs...)
		})
		if err != nil {
			t.Fatalf("write events: %v", err)
		}
	}

	st, err := table.New(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ad, err := admin.New(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	pub := h.Publisher(t, &brokers.Routing{Fixed: topic})
	t.Cleanup(func() { _ = pub.Close() })
	relay, err := core.New(st, pub, core.Options{PollInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := relay.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = relay.Stop(context.Background()) })
	dispatched := func() bool {
		s, err := ad.Status(ctx, admin.StatusOptions{})
		return err == nil && s.Pending == 0
	}
	waitUntil(t, h.Timeout, "the relay to dispatch every event", dispatched)
	t.Logf("relayed %d events in %v", consumerAggregates*consumerEvents, time.Since(start).Round(time.Millisecond))
	// Every service must have had every event before the replay, or a
	// replayed copy could be the first one a service sees.
	total := consumerAggregates * consumerEvents
	for _, svc := range consumerServices {
		waitUntil(t, h.Timeout, svc+" to acknowledge every event", func() bool { return counts[svc].acked() >= total })
	}

	replayed, err := ad.Replay(ctx, admin.Selector{AggregateID: aggs[1]}, admin.ReplayOptions{})
	if err != nil || replayed != consumerEvents {
		t.Fatalf("replay %s: %d events, %v; want %d", aggs[1], replayed, err, consumerEvents)
	}
	waitUntil(t, h.Timeout, "the relay to publish the replayed events", dispatched)
	for _, svc := range consumerServices {
		c := counts[svc]
		waitUntil(t, h.Timeout, svc+" to acknowledge the replayed copies", func() bool { return c.acked() >= total+consumerEvents })
	}

	for i, svc := range consumerServices {
		c := counts[svc]
		if i == 0 && c.failed() != 1 {
			t.Errorf("%s: %d failed deliveries, want the 1 injected", svc, c.failed())
		}
		if c.redeliveredAfterFailure() != 1 && i == 0 {
			t.Errorf("%s: the failed event was not redelivered", svc)
		}
		c.mu.Lock()
		if len(c.disorder) > 0 {
			t.Errorf("%s: events handled out of order: %v", svc, c.disorder)
		}
		c.mu.Unlock()
		got := appliedOrder(t, pool, applied, svc)
		for _, a := range aggs {
			want := make([]int, consumerEvents)
			for n := range want {
				want[n] = n + 1
			}
			if !slices.Equal(got[a], want) {
				t.Errorf("%s applied %s's events as %v, want each once in order %v", svc, a, got[a], want)
			}
		}
		var records int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{cfg.Schema, cfg.ProcessedTable}.Sanitize()+
			` WHERE consumer = $1`, svc).Scan(&records); err != nil {
			t.Fatal(err)
		}
		if records != total {
			t.Errorf("%s: %d processed records, want %d", svc, records, total)
		}
		t.Logf("%s: %d deliveries acknowledged, %d failed, %d events applied", svc, c.acked(), c.failed(), total)
	}
}

// startConsumer runs one service's router until the test ends: the
// subscriber from the harness, the dedupe middleware innermost, and a
// handler writing each event's effect in the dedupe transaction. failOn,
// "aggregate/n", names an event whose first delivery fails.
func startConsumer(t *testing.T, h ConsumerHarness, pool *pgxpool.Pool, cfg store.Config,
	svc, topic, applied string, c *deliveries, failOn string) {
	t.Helper()
	d, err := dedupe.New(pool, dedupe.Options{Consumer: svc, Store: cfg})
	if err != nil {
		t.Fatal(err)
	}
	sub := h.Subscriber(t, svc)
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(c.count, d.Middleware)
	var failed sync.Once
	r.AddConsumerHandler(svc, topic, sub, d.NoPublishHandler(func(ctx context.Context, tx pgx.Tx, msg *message.Message) error {
		var p struct{ N int }
		if err := json.Unmarshal(msg.Payload, &p); err != nil {
			return fmt.Errorf("decode: %w", err)
		}
		agg := msg.Metadata.Get(event.HeaderAggregateID)
		// In order, the aggregate's previous event committed before this
		// delivery began; a delivery that overtook it, or ran beside it,
		// does not see it.
		var last int
		if err := tx.QueryRow(ctx, `SELECT COALESCE(max(n), 0) FROM `+applied+` WHERE service = $1 AND aggregate = $2`,
			svc, agg).Scan(&last); err != nil {
			return err
		}
		if last != p.N-1 {
			c.outOfOrder(fmt.Sprintf("%s event %d after %d", agg, p.N, last))
		}
		if _, err := tx.Exec(ctx, `INSERT INTO `+applied+` (service, aggregate, n) VALUES ($1, $2, $3)`, svc, agg, p.N); err != nil {
			return err
		}
		fail := false
		if fmt.Sprintf("%s/%d", agg, p.N) == failOn {
			failed.Do(func() { fail = true })
		}
		if fail {
			c.markFailed(msg)
			return errInjected // rolls back the insert above with the dedupe record
		}
		return nil
	}))
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	select {
	case <-r.Running():
	case err := <-done:
		t.Fatalf("%s: router stopped at start: %v", svc, err)
	case <-time.After(h.Timeout):
		t.Fatalf("%s: router did not start", svc)
	}
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Errorf("%s: close router: %v", svc, err)
		}
		if err := <-done; err != nil {
			t.Errorf("%s: router: %v", svc, err)
		}
	})
}

// deliveries counts how the router settled one service's deliveries.
type deliveries struct {
	mu          sync.Mutex
	ok, errs    int
	failedID    string // the event whose delivery was made to fail
	redelivered int    // deliveries of failedID after it failed
	disorder    []string
}

func (c *deliveries) outOfOrder(what string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.disorder = append(c.disorder, what)
}

func (c *deliveries) count(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		c.mu.Lock()
		if c.failedID != "" && msg.Metadata.Get(event.HeaderEventID) == c.failedID {
			c.redelivered++
		}
		c.mu.Unlock()
		out, err := h(msg)
		c.mu.Lock()
		defer c.mu.Unlock()
		if err != nil {
			c.errs++
		} else {
			c.ok++
		}
		return out, err
	}
}

func (c *deliveries) markFailed(msg *message.Message) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.failedID = msg.Metadata.Get(event.HeaderEventID)
}

func (c *deliveries) acked() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.ok
}

func (c *deliveries) failed() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.errs
}

func (c *deliveries) redeliveredAfterFailure() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.redelivered
}

// appliedOrder returns, per aggregate, the event numbers a service applied
// in the order their transactions inserted them.
func appliedOrder(t *testing.T, pool *pgxpool.Pool, applied, svc string) map[string][]int {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT aggregate, n FROM `+applied+` WHERE service = $1 ORDER BY id`, svc)
	if err != nil {
		t.Fatalf("read applied events: %v", err)
	}
	got := map[string][]int{}
	for rows.Next() {
		var a string
		var n int
		if err := rows.Scan(&a, &n); err != nil {
			t.Fatal(err)
		}
		got[a] = append(got[a], n)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return got
}
