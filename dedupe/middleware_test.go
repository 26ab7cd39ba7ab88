package dedupe_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/wm"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
	"github.com/outboxhq/outbox/dedupe"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/table"
)

func txFrom(msg *message.Message) (pgx.Tx, bool) { return dedupe.TxFromContext[pgx.Tx](msg.Context()) }

func newDeduper(t *testing.T, pool *pgxpool.Pool, cfg store.Config, consumer string) *dedupe.Deduper[pgx.Tx] {
	t.Helper()
	d, err := dedupe.New(pool, dedupe.Options{Consumer: consumer, Store: cfg})
	if err != nil {
		t.Fatalf("new deduper: %v", err)
	}
	return d
}

func TestRedeliveredEventMovesBalanceOnce(t *testing.T) {
	forEachBroker(t, func(t *testing.T, b *testBroker) {
		pool, cfg := pgtest.Schema(t)
		l := newLoyalty(t, pool, cfg)
		d := newDeduper(t, pool, cfg, "loyalty")
		topic := randomName("orders_")
		o := startRouter(t, b.newSubscriber(t, "loyalty"), topic, l.handler, d.Middleware)

		e, customer := orderEvent(10)
		const copies = 20
		publish(t, b.newPublisher(t), topic, e, copies)
		waitAcked(t, o, copies)

		if _, errs, panics := o.counts(); errs+panics > 0 {
			t.Fatalf("deliveries failed: %v (panics %d)", o.errors(), panics)
		}
		if got := l.balance(t, customer); got != 10 {
			t.Errorf("balance after %d deliveries = %d, want 10", copies, got)
		}
		if got := l.calls.Load(); got != 1 {
			t.Errorf("handler ran %d times, want 1", got)
		}
		if got := processedCount(t, pool, cfg, "loyalty"); got != 1 {
			t.Errorf("processed rows = %d, want 1", got)
		}
	})
}

// The real relay publishes the event, an operator replays it (the row is
// pending again), and the relay publishes it a second time.
func TestRelayReplayMovesBalanceOnce(t *testing.T) {
	forEachBroker(t, func(t *testing.T, b *testBroker) {
		pool, cfg := pgtest.Schema(t)
		l := newLoyalty(t, pool, cfg)
		d := newDeduper(t, pool, cfg, "loyalty")
		topic := randomName("orders_")
		o := startRouter(t, b.newSubscriber(t, "loyalty"), topic, l.handler, d.Middleware)

		st, err := table.New(pool, cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		relay, err := core.New(st, wm.New(b.newPublisher(t), &brokers.Routing{Fixed: topic}, nil),
			core.Options{PollInterval: 20 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		if err := relay.Start(ctx); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			cancel()
			if err := relay.Stop(context.Background()); err != nil {
				t.Errorf("stop relay: %v", err)
			}
		})

		w, err := outbox.NewWriter(outbox.WriterOptions{Store: cfg})
		if err != nil {
			t.Fatal(err)
		}
		e, customer := orderEvent(7)
		err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			return w.Write(ctx, tx, outbox.Message{AggregateID: e.AggregateID, Type: e.Type, Payload: e.Payload})
		})
		if err != nil {
			t.Fatalf("write event: %v", err)
		}
		waitAcked(t, o, 1)

		outboxTable := pgx.Identifier{cfg.Schema, "events_outbox"}.Sanitize()
		for replay := 1; replay <= 3; replay++ {
			if _, err := pool.Exec(ctx, `UPDATE `+outboxTable+` SET dispatched_at = NULL`); err != nil {
				t.Fatalf("replay: %v", err)
			}
			relay.Wake()
			waitAcked(t, o, 1+replay)
		}
		if _, errs, panics := o.counts(); errs+panics > 0 {
			t.Fatalf("deliveries failed: %v (panics %d)", o.errors(), panics)
		}
		if got := l.balance(t, customer); got != 7 {
			t.Errorf("balance after replays = %d, want 7", got)
		}
		if got := l.calls.Load(); got != 1 {
			t.Errorf("handler ran %d times, want 1", got)
		}
	})
}

func TestFailedHandlerRunsAgainAndAppliesOnce(t *testing.T) {
	for _, failure := range []string{"error", "panic"} {
		t.Run(failure, func(t *testing.T) {
			forEachBroker(t, func(t *testing.T, b *testBroker) {
				pool, cfg := pgtest.Schema(t)
				l := newLoyalty(t, pool, cfg)
				d := newDeduper(t, pool, cfg, "loyalty")
				var attempts atomic.Int64
				h := func(msg *message.Message) ([]*message.Message, error) {
					// The effect is written before the failure, so only the
					// rollback keeps it from counting twice.
					if _, err := l.handler(msg); err != nil {
						return nil, err
					}
					if attempts.Add(1) == 1 {
						if failure == "panic" {
							panic("handler bug")
						}
						return nil, errors.New("downstream unavailable")
					}
					return nil, nil
				}
				topic := randomName("orders_")
				o := startRouter(t, b.newSubscriber(t, "loyalty"), topic, h, d.Middleware)

				e, customer := orderEvent(5)
				publish(t, b.newPublisher(t), topic, e, 1)
				waitAcked(t, o, 1)

				_, errs, panics := o.counts()
				if failure == "error" && (errs != 1 || panics != 0) {
					t.Errorf("errors %d, panics %d; want 1 error", errs, panics)
				}
				if failure == "panic" && (errs != 0 || panics != 1) {
					t.Errorf("errors %d, panics %d; want 1 panic", errs, panics)
				}
				if got := l.balance(t, customer); got != 5 {
					t.Errorf("balance = %d, want 5", got)
				}
				if got := l.calls.Load(); got != 2 {
					t.Errorf("handler ran %d times, want 2", got)
				}
			})
		})
	}
}

func TestConsumersDedupeIndependently(t *testing.T) {
	forEachBroker(t, func(t *testing.T, b *testBroker) {
		pool, cfg := pgtest.Schema(t)
		loyaltyA := newLoyalty(t, pool, cfg)
		loyaltyB := &loyalty{pool: pool, table: pgx.Identifier{cfg.Schema, "loyalty_points_b"}.Sanitize()}
		if _, err := pool.Exec(context.Background(), `CREATE TABLE `+loyaltyB.table+` (customer_id UUID PRIMARY KEY, balance BIGINT NOT NULL)`); err != nil {
			t.Fatal(err)
		}
		topic := randomName("orders_")
		oa := startRouter(t, b.newSubscriber(t, "a"), topic, loyaltyA.handler, newDeduper(t, pool, cfg, "consumer-a").Middleware)
		ob := startRouter(t, b.newSubscriber(t, "b"), topic, loyaltyB.handler, newDeduper(t, pool, cfg, "consumer-b").Middleware)

		e, customer := orderEvent(3)
		publish(t, b.newPublisher(t), topic, e, 3)
		eventually(t, "both consumers acked every copy", func() bool {
			a, _, _ := oa.counts()
			b, _, _ := ob.counts()
			return a >= 3 && b >= 3
		})
		if a, _, _ := oa.counts(); a != 3 {
			t.Errorf("consumer a acked %d deliveries, want 3", a)
		}
		if b, _, _ := ob.counts(); b != 3 {
			t.Errorf("consumer b acked %d deliveries, want 3", b)
		}
		for name, l := range map[string]*loyalty{"a": loyaltyA, "b": loyaltyB} {
			if got := l.balance(t, customer); got != 3 {
				t.Errorf("consumer %s: balance = %d, want 3", name, got)
			}
			if got := l.calls.Load(); got != 1 {
				t.Errorf("consumer %s: handler ran %d times, want 1", name, got)
			}
		}
		for _, c := range []string{"consumer-a", "consumer-b"} {
			if got := processedCount(t, pool, cfg, c); got != 1 {
				t.Errorf("%s: processed rows = %d, want 1", c, got)
			}
		}
	})
}

// A process that dies after the commit but before the ack: the broker
// redelivers an event whose effect is already committed. crashOnce sits
// outside the middleware and turns the first successful result into a
// nack, as the lost ack would.
func TestCrashAfterCommitBeforeAck(t *testing.T) {
	forEachBroker(t, func(t *testing.T, b *testBroker) {
		pool, cfg := pgtest.Schema(t)
		l := newLoyalty(t, pool, cfg)
		d := newDeduper(t, pool, cfg, "loyalty")
		var crashed atomic.Bool
		crashOnce := func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				out, err := h(msg)
				if err == nil && crashed.CompareAndSwap(false, true) {
					return nil, errors.New("simulated crash before ack")
				}
				return out, err
			}
		}
		topic := randomName("orders_")
		o := startRouter(t, b.newSubscriber(t, "loyalty"), topic, l.handler, crashOnce, d.Middleware)

		e, customer := orderEvent(9)
		publish(t, b.newPublisher(t), topic, e, 1)
		waitAcked(t, o, 1)

		if _, errs, _ := o.counts(); errs != 1 {
			t.Errorf("nacked deliveries = %d, want 1 (the crash)", errs)
		}
		if got := l.balance(t, customer); got != 9 {
			t.Errorf("balance = %d, want 9", got)
		}
		if got := l.calls.Load(); got != 1 {
			t.Errorf("handler ran %d times, want 1", got)
		}
	})
}

// Two router instances of one consumer get copies of one event at the same
// time. The first holds its transaction until the second is seen waiting on
// the dedupe row, then commits (or fails): the second must then skip (or
// run) without an error of its own.
func TestConcurrentDuplicatesOnTwoRouters(t *testing.T) {
	for _, firstFails := range []bool{false, true} {
		name := "first commits"
		if firstFails {
			name = "first rolls back"
		}
		t.Run(name, func(t *testing.T) {
			forEachBroker(t, func(t *testing.T, b *testBroker) {
				pool, cfg := pgtest.Schema(t)
				l := newLoyalty(t, pool, cfg)
				var entered atomic.Int64
				var sawWaiter atomic.Bool
				h := func(msg *message.Message) ([]*message.Message, error) {
					if _, err := l.handler(msg); err != nil {
						return nil, err
					}
					if entered.Add(1) > 1 {
						return nil, nil
					}
					if err := waitForLockWaiter(msg.Context(), pool, cfg.Schema); err != nil {
						return nil, err
					}
					sawWaiter.Store(true)
					if firstFails {
						return nil, errors.New("first delivery fails")
					}
					return nil, nil
				}
				topic := randomName("orders_")
				// Separate Dedupers, as in two processes.
				o1 := startRouter(t, b.newSubscriber(t, "loyalty"), topic, h, newDeduper(t, pool, cfg, "loyalty").Middleware)
				o2 := startRouter(t, b.newSubscriber(t, "loyalty"), topic, h, newDeduper(t, pool, cfg, "loyalty").Middleware)

				e, customer := orderEvent(4)
				const copies = 2
				publish(t, b.newPublisher(t), topic, e, copies)
				want := copies // competing consumers share the copies
				if b.fanOut {
					want = 2 * copies
				}
				eventually(t, "every copy acked", func() bool {
					ok1, _, _ := o1.counts()
					ok2, _, _ := o2.counts()
					return ok1+ok2 >= want
				})
				ok1, _, _ := o1.counts()
				ok2, _, _ := o2.counts()
				if ok1+ok2 != want {
					t.Errorf("acked deliveries = %d, want %d", ok1+ok2, want)
				}

				if !sawWaiter.Load() {
					t.Fatal("the duplicate never waited on the first delivery's row")
				}
				errs := append(o1.errors(), o2.errors()...)
				wantErrs := 0
				if firstFails {
					wantErrs = 1
				}
				if len(errs) != wantErrs {
					t.Errorf("failed deliveries: %v; want %d", errs, wantErrs)
				}
				if got := l.balance(t, customer); got != 4 {
					t.Errorf("balance = %d, want 4", got)
				}
				wantCalls := int64(1)
				if firstFails {
					wantCalls = 2
				}
				if got := l.calls.Load(); got != wantCalls {
					t.Errorf("handler ran %d times, want %d", got, wantCalls)
				}
			})
		})
	}
}

// Consume, then emit the next event through the outbox in the same
// transaction: the inbox record and the outbox row commit together.
func TestHandlerEmitsThroughOutboxOnce(t *testing.T) {
	forEachBroker(t, func(t *testing.T, b *testBroker) {
		pool, cfg := pgtest.Schema(t)
		l := newLoyalty(t, pool, cfg)
		d := newDeduper(t, pool, cfg, "loyalty")
		w, err := outbox.NewWriter(outbox.WriterOptions{Store: cfg})
		if err != nil {
			t.Fatal(err)
		}
		var attempts atomic.Int64
		h := d.Handler(func(ctx context.Context, tx pgx.Tx, msg *message.Message) ([]*message.Message, error) {
			if err := l.award(ctx, tx, msg.Payload); err != nil {
				return nil, err
			}
			err := w.Write(ctx, tx, outbox.Message{
				AggregateID: msg.Metadata.Get(event.HeaderAggregateID),
				Type:        "points.awarded",
				Payload:     msg.Payload,
			})
			if err != nil {
				return nil, err
			}
			if attempts.Add(1) == 1 {
				return nil, errors.New("fail after writing the outbox row")
			}
			return nil, nil
		})
		topic := randomName("orders_")
		o := startRouter(t, b.newSubscriber(t, "loyalty"), topic, h)

		e, customer := orderEvent(2)
		publish(t, b.newPublisher(t), topic, e, 3)
		waitAcked(t, o, 3)

		var n int
		err = pool.QueryRow(context.Background(), `SELECT count(*) FROM `+
			pgx.Identifier{cfg.Schema, "events_outbox"}.Sanitize()+` WHERE type = 'points.awarded'`).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		if n != 1 {
			t.Errorf("points.awarded events in the outbox = %d, want 1", n)
		}
		if got := l.balance(t, customer); got != 2 {
			t.Errorf("balance = %d, want 2", got)
		}
	})
}

// Handler inside Middleware of the same Deduper shares its transaction
// instead of waiting on its own row.
func TestHandlerBehindMiddlewareSharesTransaction(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	b := newGoChannelBroker(t)
	l := newLoyalty(t, pool, cfg)
	d := newDeduper(t, pool, cfg, "loyalty")
	var same atomic.Bool
	h := d.Handler(func(ctx context.Context, tx pgx.Tx, msg *message.Message) ([]*message.Message, error) {
		outer, _ := dedupe.TxFromContext[pgx.Tx](ctx)
		same.Store(outer == tx)
		return nil, l.award(ctx, tx, msg.Payload)
	})
	topic := randomName("orders_")
	o := startRouter(t, b.newSubscriber(t, ""), topic, h, d.Middleware)
	e, customer := orderEvent(6)
	publish(t, b.newPublisher(t), topic, e, 2)
	waitAcked(t, o, 2)
	if got := l.balance(t, customer); got != 6 {
		t.Errorf("balance = %d, want 6", got)
	}
	if !same.Load() {
		t.Error("the handler got a transaction other than the middleware's")
	}
}

// syncBuffer is a log sink safe for the router's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestMissingEventID(t *testing.T) {
	noID := func() *message.Message {
		return message.NewMessage(watermill.NewUUID(), []byte(`{"customer_id":"00000000-0000-0000-0000-000000000001","points":1}`))
	}

	t.Run("reject goes to the poison queue", func(t *testing.T) {
		pool, cfg := pgtest.Schema(t)
		l := newLoyalty(t, pool, cfg)
		var logs syncBuffer
		d, err := dedupe.New(pool, dedupe.Options{Consumer: "loyalty", Store: cfg, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
		if err != nil {
			t.Fatal(err)
		}
		ch := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, watermill.NopLogger{})
		t.Cleanup(func() { _ = ch.Close() })
		poisoned, err := ch.Subscribe(context.Background(), "poison")
		if err != nil {
			t.Fatal(err)
		}
		poison, err := middleware.PoisonQueueWithFilter(ch, "poison", func(err error) bool { return errors.Is(err, dedupe.ErrNoEventID) })
		if err != nil {
			t.Fatal(err)
		}
		topic := randomName("orders_")
		o := startRouter(t, keepOpenSub{ch}, topic, l.handler, poison, d.Middleware)
		if err := ch.Publish(topic, noID()); err != nil {
			t.Fatal(err)
		}
		select {
		case msg := <-poisoned:
			msg.Ack()
			if reason := msg.Metadata.Get(middleware.ReasonForPoisonedKey); !strings.Contains(reason, "event_id") {
				t.Errorf("poison reason %q does not name the header", reason)
			}
		case <-time.After(waitFor):
			t.Fatal("the message did not reach the poison queue")
		}
		waitAcked(t, o, 1)
		if got := l.calls.Load(); got != 0 {
			t.Errorf("handler ran %d times, want 0", got)
		}
		if s := logs.String(); !strings.Contains(s, "level=ERROR") || !strings.Contains(s, "message without event identity") {
			t.Errorf("no error logged; log:\n%s", s)
		}
	})

	t.Run("reject without poison queue nacks", func(t *testing.T) {
		pool, cfg := pgtest.Schema(t)
		d := newDeduper(t, pool, cfg, "loyalty")
		msg := noID()
		_, err := d.Middleware(func(*message.Message) ([]*message.Message, error) {
			t.Error("handler ran for a rejected message")
			return nil, nil
		})(msg)
		if !errors.Is(err, dedupe.ErrNoEventID) {
			t.Fatalf("error = %v, want ErrNoEventID", err)
		}
		if !strings.Contains(err.Error(), msg.UUID) {
			t.Errorf("error %q does not name the message", err)
		}
	})

	t.Run("process without dedupe", func(t *testing.T) {
		pool, cfg := pgtest.Schema(t)
		l := newLoyalty(t, pool, cfg)
		var logs syncBuffer
		d, err := dedupe.New(pool, dedupe.Options{
			Consumer: "loyalty", Store: cfg, MissingID: dedupe.ProcessWithoutDedupe,
			Logger: slog.New(slog.NewTextHandler(&logs, nil)),
		})
		if err != nil {
			t.Fatal(err)
		}
		b := newGoChannelBroker(t)
		topic := randomName("orders_")
		o := startRouter(t, b.newSubscriber(t, ""), topic, l.handler, d.Middleware)
		msg := noID()
		for i := 0; i < 2; i++ {
			if err := b.newPublisher(t).Publish(topic, msg.Copy()); err != nil {
				t.Fatal(err)
			}
		}
		waitAcked(t, o, 2)
		if got := l.calls.Load(); got != 2 {
			t.Errorf("handler ran %d times, want 2 (no dedupe)", got)
		}
		if got := l.balance(t, "00000000-0000-0000-0000-000000000001"); got != 2 {
			t.Errorf("balance = %d, want 2", got)
		}
		if got := processedCount(t, pool, cfg, "loyalty"); got != 0 {
			t.Errorf("processed rows = %d, want 0", got)
		}
		if s := logs.String(); strings.Count(s, "message without event identity") != 2 {
			t.Errorf("want one error logged per message; log:\n%s", s)
		}
	})
}

// The key is the same for a message from a relay before migration 5
// (event_id held the row position, event_uid the identity), one from a
// relay after it (both hold the identity) and one from another producer
// that sends only event_id.
func TestEventIDAcrossRelayVersions(t *testing.T) {
	const uid = "0199a1b2-3c4d-7e5f-8a9b-0c1d2e3f4a5b"
	for name, md := range map[string]message.Metadata{
		"before migration 5": {event.HeaderEventID: "41", event.HeaderEventUID: uid},
		"after migration 5":  wm.NewMessage(&core.Event{Seq: 41, ID: uid, AggregateID: "a", Type: "t.x"}).Metadata,
		"event_id only":      {event.HeaderEventID: uid},
	} {
		msg := message.NewMessage(watermill.NewUUID(), nil)
		msg.Metadata = md
		if got, err := dedupe.EventID(msg); err != nil || got != uid {
			t.Errorf("%s: EventID = %q, %v; want %q", name, got, err, uid)
		}
	}
}
