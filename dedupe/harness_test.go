package dedupe_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/outboxhq/outbox/brokers/wm"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

const waitFor = 30 * time.Second

// eventually polls cond until it holds or the wait runs out.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitFor)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func randomName(prefix string) string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// testBroker hands out publishers and subscribers of one broker.
type testBroker struct {
	name string
	// fanOut: every subscriber of a topic gets every message. Otherwise
	// subscribers of one group compete for the messages, and each group
	// gets every message.
	fanOut        bool
	newPublisher  func(t *testing.T) message.Publisher
	newSubscriber func(t *testing.T, group string) message.Subscriber
}

// forEachBroker runs fn against GoChannel and, when a server is named by
// OUTBOX_TEST_AMQP_URL, RabbitMQ.
func forEachBroker(t *testing.T, fn func(t *testing.T, b *testBroker)) {
	t.Run("gochannel", func(t *testing.T) { fn(t, newGoChannelBroker(t)) })
	t.Run("rabbitmq", func(t *testing.T) { fn(t, newAMQPBroker(t)) })
}

func newGoChannelBroker(t *testing.T) *testBroker {
	ch := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ch.Close() })
	return &testBroker{
		name:          "gochannel",
		fanOut:        true,
		newPublisher:  func(*testing.T) message.Publisher { return keepOpen{ch} },
		newSubscriber: func(*testing.T, string) message.Subscriber { return keepOpenSub{ch} },
	}
}

// keepOpen and keepOpenSub stop a router closing the shared GoChannel.
type keepOpen struct{ message.Publisher }

func (keepOpen) Close() error { return nil }

type keepOpenSub struct{ message.Subscriber }

func (keepOpenSub) Close() error { return nil }

func newAMQPBroker(t *testing.T) *testBroker {
	url := os.Getenv("OUTBOX_TEST_AMQP_URL")
	if url == "none" { // left out on purpose, as by make test-pg
		t.Skip("OUTBOX_TEST_AMQP_URL is none: the RabbitMQ cases are left out")
	}
	if url == "" {
		if os.Getenv("CI") != "" {
			t.Fatal("OUTBOX_TEST_AMQP_URL is not set; run the tests under scripts/services.sh")
		}
		t.Skip("OUTBOX_TEST_AMQP_URL is not set; scripts/services.sh starts RabbitMQ")
	}
	// A fanout exchange per topic and a durable queue per group.
	config := func(group string) amqp.Config {
		return amqp.NewDurablePubSubConfig(url, amqp.GenerateQueueNameTopicNameWithSuffix(group))
	}
	return &testBroker{
		name: "rabbitmq",
		newPublisher: func(t *testing.T) message.Publisher {
			pub, err := amqp.NewPublisher(config(""), watermill.NopLogger{})
			if err != nil {
				t.Fatalf("amqp publisher: %v", err)
			}
			t.Cleanup(func() { _ = pub.Close() })
			return pub
		},
		newSubscriber: func(t *testing.T, group string) message.Subscriber {
			sub, err := amqp.NewSubscriber(config(group), watermill.NopLogger{})
			if err != nil {
				t.Fatalf("amqp subscriber: %v", err)
			}
			t.Cleanup(func() { _ = sub.Close() })
			return sub
		},
	}
}

// outcomes records what the router saw of each delivery.
type outcomes struct {
	mu     sync.Mutex
	ok     int
	errs   []error
	panics int
}

// observe is the outermost middleware: it counts deliveries as the router
// will settle them (nil error: ack; error or panic: nack).
func (o *outcomes) observe(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) (out []*message.Message, err error) {
		settled := false
		defer func() {
			o.mu.Lock()
			defer o.mu.Unlock()
			switch {
			case !settled:
				o.panics++
			case err != nil:
				o.errs = append(o.errs, err)
			default:
				o.ok++
			}
		}()
		out, err = h(msg)
		settled = true
		return out, err
	}
}

func (o *outcomes) counts() (ok, errs, panics int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.ok, len(o.errs), o.panics
}

// waitAcked waits for n acked deliveries and fails on more.
func waitAcked(t *testing.T, o *outcomes, n int) {
	t.Helper()
	eventually(t, fmt.Sprintf("%d acked deliveries", n), func() bool { ok, _, _ := o.counts(); return ok >= n })
	if ok, _, _ := o.counts(); ok != n {
		t.Fatalf("acked deliveries = %d, want %d", ok, n)
	}
}

func (o *outcomes) errors() []error {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]error(nil), o.errs...)
}

// startRouter runs a router with one handler on topic until the test ends.
// The outcomes middleware is added first, then mws in order.
func startRouter(t *testing.T, sub message.Subscriber, topic string, h message.HandlerFunc, mws ...message.HandlerMiddleware) *outcomes {
	t.Helper()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatalf("new router: %v", err)
	}
	o := &outcomes{}
	r.AddMiddleware(o.observe)
	r.AddMiddleware(mws...)
	r.AddHandler(randomName("h"), topic, sub, "", disabledPublisher{}, h)
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	select {
	case <-r.Running():
	case err := <-done:
		t.Fatalf("router stopped at start: %v", err)
	case <-time.After(waitFor):
		t.Fatal("router did not start")
	}
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Errorf("close router: %v", err)
		}
		if err := <-done; err != nil {
			t.Errorf("router run: %v", err)
		}
	})
	return o
}

// disabledPublisher fails the test's handlers that return messages
// where none are expected.
type disabledPublisher struct{}

func (disabledPublisher) Publish(topic string, _ ...*message.Message) error {
	return fmt.Errorf("unexpected publish to %s", topic)
}
func (disabledPublisher) Close() error { return nil }

// The loyalty-points example: each order.placed event adds its points to
// the customer's balance, which must move once per event.

type orderPlaced struct {
	CustomerID string `json:"customer_id"`
	Points     int64  `json:"points"`
}

type loyalty struct {
	pool  *pgxpool.Pool
	table string
	calls atomic.Int64 // handler runs, committed or not
}

func newLoyalty(t *testing.T, pool *pgxpool.Pool, cfg store.Config) *loyalty {
	t.Helper()
	l := &loyalty{pool: pool, table: pgx.Identifier{cfg.Schema, "loyalty_points"}.Sanitize()}
	_, err := pool.Exec(context.Background(),
		`CREATE TABLE `+l.table+` (customer_id UUID PRIMARY KEY, balance BIGINT NOT NULL)`)
	if err != nil {
		t.Fatalf("create loyalty table: %v", err)
	}
	return l
}

// award applies the event's points on tx.
func (l *loyalty) award(ctx context.Context, tx pgx.Tx, payload []byte) error {
	l.calls.Add(1)
	var o orderPlaced
	if err := json.Unmarshal(payload, &o); err != nil {
		return fmt.Errorf("decode order: %w", err)
	}
	_, err := tx.Exec(ctx, `INSERT INTO `+l.table+` (customer_id, balance) VALUES ($1, $2)
ON CONFLICT (customer_id) DO UPDATE SET balance = `+l.table+`.balance + EXCLUDED.balance`, o.CustomerID, o.Points)
	if err != nil {
		return fmt.Errorf("award points: %w", err)
	}
	return nil
}

// handler awards points in the transaction the middleware set.
func (l *loyalty) handler(msg *message.Message) ([]*message.Message, error) {
	tx, ok := txFrom(msg)
	if !ok {
		return nil, errors.New("no dedupe transaction in the message context")
	}
	return nil, l.award(msg.Context(), tx, msg.Payload)
}

func (l *loyalty) balance(t *testing.T, customer string) int64 {
	t.Helper()
	var b int64
	err := l.pool.QueryRow(context.Background(), `SELECT COALESCE(sum(balance), 0) FROM `+l.table+` WHERE customer_id = $1`, customer).Scan(&b)
	if err != nil {
		t.Fatalf("read balance: %v", err)
	}
	return b
}

// orderEvent builds an order.placed event as the relay stores it.
func orderEvent(points int64) (*core.Event, string) {
	customer := uuid.NewString()
	payload, _ := json.Marshal(orderPlaced{CustomerID: customer, Points: points})
	return &core.Event{
		Seq: 1, ID: uuid.NewString(), AggregateID: uuid.NewString(),
		Type: "order.placed", Payload: payload,
	}, customer
}

// publish sends e as the relay would, n times.
func publish(t *testing.T, pub message.Publisher, topic string, e *core.Event, n int) {
	t.Helper()
	for i := 0; i < n; i++ {
		if err := pub.Publish(topic, wm.NewMessage(e)); err != nil {
			t.Fatalf("publish: %v", err)
		}
	}
}

func processedCount(t *testing.T, pool *pgxpool.Pool, cfg store.Config, consumer string) int {
	t.Helper()
	var n int
	err := pool.QueryRow(context.Background(),
		`SELECT count(*) FROM `+pgx.Identifier{cfg.Schema, "processed_events"}.Sanitize()+` WHERE consumer = $1`, consumer).Scan(&n)
	if err != nil {
		t.Fatalf("count processed events: %v", err)
	}
	return n
}

// lockWaiters counts sessions waiting for a row lock on a statement naming
// the test's schema: a concurrent duplicate blocked on the first delivery.
func lockWaiters(ctx context.Context, pool *pgxpool.Pool, schema string) (int, error) {
	var n int
	err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
WHERE wait_event_type = 'Lock' AND pid <> pg_backend_pid() AND strpos(query, $1) > 0`, schema).Scan(&n)
	return n, err
}

// waitForLockWaiter polls until a concurrent duplicate waits on the row.
func waitForLockWaiter(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	ctx, cancel := context.WithTimeout(ctx, waitFor)
	defer cancel()
	for {
		n, err := lockWaiters(ctx, pool, schema)
		if err != nil {
			return fmt.Errorf("no concurrent duplicate seen waiting: %w", err)
		}
		if n > 0 {
			return nil
		}
		time.Sleep(5 * time.Millisecond)
	}
}
