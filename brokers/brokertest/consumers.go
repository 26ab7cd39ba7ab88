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
	c := newConsumersRun(t, h)
	start := time.Now()
	c.write(t)
	ad := c.relay(t, start)
	c.replay(t, ad)
	for i, svc := range consumerServices {
		c.check(t, svc, i == 0)
	}
}

// consumersRun is one RunConsumers: its schema, the table where the
// services apply events, and what each service's router counted.
type consumersRun struct {
	h       ConsumerHarness
	pool    *pgxpool.Pool
	cfg     store.Config
	applied string // the services' effects table, quoted
	topic   string
	aggs    []string
	counts  map[string]*deliveries
}

// newConsumersRun makes the schema and the effects table, and starts every
// service's consumer: services subscribe first, as a queue or subscription
// created after an event was published never gets it.
func newConsumersRun(t *testing.T, h ConsumerHarness) *consumersRun {
	t.Helper()
	pool, cfg := pgtest.Schema(t)
	cfg, err := cfg.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	c := &consumersRun{h: h, pool: pool, cfg: cfg, applied: pgx.Identifier{cfg.Schema, "applied"}.Sanitize(),
		topic: "consumers-" + uniquePrefix()[2:12], aggs: make([]string, consumerAggregates), counts: map[string]*deliveries{}}
	if _, err := pool.Exec(t.Context(), `CREATE TABLE `+c.applied+` (
    id bigserial PRIMARY KEY, service text NOT NULL, aggregate text NOT NULL, n int NOT NULL)`); err != nil {
		t.Fatalf("create applied table: %v", err)
	}
	for i := range c.aggs {
		c.aggs[i] = fmt.Sprintf("acct-%d", i)
	}
	for i, svc := range consumerServices {
		d := &deliveries{}
		c.counts[svc] = d
		failOn := ""
		if i == 0 {
			failOn = c.aggs[0] + "/3"
		}
		startConsumer(t, h, pool, cfg, svc, c.topic, c.applied, d, failOn)
	}
	return c
}

// write writes every event with outbox.Writer, interleaving the aggregates.
func (c *consumersRun) write(t *testing.T) {
	t.Helper()
	ctx := t.Context()
	w, err := outbox.NewWriter(outbox.WriterOptions{Store: c.cfg})
	if err != nil {
		t.Fatal(err)
	}
	for n := 1; n <= consumerEvents; n++ {
		err := pgx.BeginFunc(ctx, c.pool, func(tx pgx.Tx) error {
			msgs := make([]outbox.Message, 0, len(c.aggs))
			for _, a := range c.aggs {
				msgs = append(msgs, outbox.Message{AggregateID: a, Type: "account.changed", Payload: map[string]int{"n": n}})
			}
			return w.Write(ctx, tx, msgs...)
		})
		if err != nil {
			t.Fatalf("write events: %v", err)
		}
	}
}

// relay starts the core relay through the adapter and waits until every
// service acknowledged every event, written since start. It returns the
// operator's view of the outbox.
func (c *consumersRun) relay(t *testing.T, start time.Time) *admin.Admin {
	t.Helper()
	ctx := t.Context()
	st, err := table.New(c.pool, c.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ad, err := admin.New(c.pool, c.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	pub := c.h.Publisher(t, &brokers.Routing{Fixed: c.topic})
	t.Cleanup(func() { _ = pub.Close() })
	relay, err := core.New(st, pub, core.Options{PollInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := relay.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = relay.Stop(context.Background()) })
	waitUntil(t, c.h.Timeout, "the relay to dispatch every event", c.dispatched(ctx, ad))
	t.Logf("relayed %d events in %v", consumerAggregates*consumerEvents, time.Since(start).Round(time.Millisecond))
	// Every service must have had every event before the replay, or a
	// replayed copy could be the first one a service sees.
	c.waitAcked(t, "every event", consumerAggregates*consumerEvents)
	return ad
}

// replay has an operator replay one aggregate's events and waits until
// every service acknowledged the copies.
func (c *consumersRun) replay(t *testing.T, ad *admin.Admin) {
	t.Helper()
	replayed, err := ad.Replay(t.Context(), admin.Selector{AggregateID: c.aggs[1]}, admin.ReplayOptions{})
	if err != nil || replayed != consumerEvents {
		t.Fatalf("replay %s: %d events, %v; want %d", c.aggs[1], replayed, err, consumerEvents)
	}
	waitUntil(t, c.h.Timeout, "the relay to publish the replayed events", c.dispatched(t.Context(), ad))
	c.waitAcked(t, "the replayed copies", consumerAggregates*consumerEvents+consumerEvents)
}

func (c *consumersRun) dispatched(ctx context.Context, ad *admin.Admin) func() bool {
	return func() bool {
		s, err := ad.Status(ctx, admin.StatusOptions{})
		return err == nil && s.Pending == 0
	}
}

func (c *consumersRun) waitAcked(t *testing.T, what string, n int) {
	t.Helper()
	for _, svc := range consumerServices {
		d := c.counts[svc]
		waitUntil(t, c.h.Timeout, svc+" to acknowledge "+what, func() bool { return d.acked() >= n })
	}
}

// check says whether svc applied every event once and in order, recorded
// each once, and (injected) had its one failed delivery redelivered.
func (c *consumersRun) check(t *testing.T, svc string, injected bool) {
	t.Helper()
	d := c.counts[svc]
	if injected && d.failed() != 1 {
		t.Errorf("%s: %d failed deliveries, want the 1 injected", svc, d.failed())
	}
	if d.redeliveredAfterFailure() != 1 && injected {
		t.Errorf("%s: the failed event was not redelivered", svc)
	}
	d.mu.Lock()
	if len(d.disorder) > 0 {
		t.Errorf("%s: events handled out of order: %v", svc, d.disorder)
	}
	d.mu.Unlock()
	got := appliedOrder(t, c.pool, c.applied, svc)
	want := make([]int, consumerEvents)
	for n := range want {
		want[n] = n + 1
	}
	for _, a := range c.aggs {
		if !slices.Equal(got[a], want) {
			t.Errorf("%s applied %s's events as %v, want each once in order %v", svc, a, got[a], want)
		}
	}
	total := consumerAggregates * consumerEvents
	var records int
	if err := c.pool.QueryRow(t.Context(), `SELECT count(*) FROM `+pgx.Identifier{c.cfg.Schema, c.cfg.ProcessedTable}.Sanitize()+
		` WHERE consumer = $1`, svc).Scan(&records); err != nil {
		t.Fatal(err)
	}
	if records != total {
		t.Errorf("%s: %d processed records, want %d", svc, records, total)
	}
	t.Logf("%s: %d deliveries acknowledged, %d failed, %d events applied", svc, d.acked(), d.failed(), total)
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
