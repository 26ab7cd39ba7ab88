package amqp_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/amqp"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store/admin"
	"github.com/outboxhq/outbox/store/table"
)

// channel opens a channel on a connection of the test's own.
func channel(t testing.TB, raw string) *amqp091.Channel {
	t.Helper()
	conn, err := amqp091.Dial(raw)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	return ch
}

// bindQueue declares a durable queue named queue, bound to exchange with
// key, as a consuming service does, and deletes it at cleanup.
func bindQueue(t testing.TB, raw, exchange, key, queue string) {
	t.Helper()
	ch := channel(t, raw)
	if err := ch.ExchangeDeclare(exchange, "topic", true, false, false, false, nil); err != nil {
		t.Fatalf("declare exchange %s: %v", exchange, err)
	}
	if _, err := ch.QueueDeclare(queue, true, false, false, false, nil); err != nil {
		t.Fatalf("declare queue %s: %v", queue, err)
	}
	if err := ch.QueueBind(queue, key, exchange, false, nil); err != nil {
		t.Fatalf("bind queue %s: %v", queue, err)
	}
	t.Cleanup(func() { deleteQueue(t, raw, queue) })
}

// queueExists asks the broker whether a queue of that name exists.
func queueExists(t testing.TB, raw, queue string) bool {
	t.Helper()
	_, err := channel(t, raw).QueueDeclarePassive(queue, true, false, false, false, nil)
	var ae *amqp091.Error
	if errors.As(err, &ae) && ae.Code == amqp091.NotFound {
		return false
	}
	if err != nil {
		t.Fatalf("declare queue %s passively: %v", queue, err)
	}
	return true
}

func uniqueTopic(t testing.TB) string {
	return fmt.Sprintf("%s-%d", strings.ReplaceAll(t.Name(), "/", "-"), time.Now().UnixNano())
}

// A publish that no queue receives fails, with a reason naming the cause,
// and is retried, not held; once a queue is bound it goes out. The
// publisher declares the exchange and no queue.
func TestPublishWithoutQueueFails(t *testing.T) {
	raw := rabbitURL(t)
	topic := uniqueTopic(t)
	pub, err := amqp.New(t.Context(), amqp.Config{URL: raw, Channels: 2}, &brokers.Routing{Fixed: topic}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	t.Cleanup(func() { deleteQueue(t, raw, topic) })
	e := &core.Event{Seq: 1, ID: "00000000-0000-4000-8000-000000000001", AggregateID: "a", Type: "t.x", Payload: []byte(`{}`)}
	// Twice: the channel that carried a returned message serves the next.
	for range 2 {
		err = pub.Publish(t.Context(), e)
		if !errors.Is(err, amqp.ErrNoQueue) {
			t.Fatalf("publish with no queue bound: %v, want ErrNoQueue", err)
		}
		if core.IsPermanent(err) || !core.IsUndeliverable(err) {
			t.Fatalf("publish with no queue bound: %v; want transient and undeliverable, retried", err)
		}
	}
	if !strings.Contains(err.Error(), topic) || !strings.Contains(err.Error(), "NO_ROUTE") {
		t.Errorf("error %q does not name the exchange and the broker's reason", err)
	}
	if queueExists(t, raw, topic) {
		t.Errorf("the publisher declared queue %s", topic)
	}

	bindQueue(t, raw, topic, topic, topic)
	e.Seq, e.ID = 2, "00000000-0000-4000-8000-000000000002"
	if err := pub.Publish(t.Context(), e); err != nil {
		t.Fatalf("publish with a queue bound: %v", err)
	}
	if got := read(t, raw, topic, 1); got[0].Headers[event.HeaderEventSeq] != "2" {
		t.Errorf("delivered %+v, want event 2", got[0])
	}
}

// TopicQueues keeps the earlier topology: a durable queue named after the
// topic receives events before any service has a queue.
func TestTopicQueues(t *testing.T) {
	raw := rabbitURL(t)
	topic := uniqueTopic(t)
	t.Cleanup(func() { deleteQueue(t, raw, topic) })
	pub, err := amqp.New(t.Context(), amqp.Config{URL: raw, TopicQueues: true}, &brokers.Routing{Fixed: topic}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	e := &core.Event{Seq: 5, ID: "00000000-0000-4000-8000-000000000005", AggregateID: "a", Type: "t.x", Payload: []byte(`{}`)}
	if err := pub.Publish(t.Context(), e); err != nil {
		t.Fatal(err)
	}
	if got := read(t, raw, topic, 1); got[0].Headers[event.HeaderEventSeq] != "5" {
		t.Errorf("delivered %+v, want event 5", got[0])
	}
}

// Through the relay and a real table: an event whose topic no queue
// receives stays pending with its attempts and reason recorded for
// operators, and no queue is declared for it; once a service binds its
// queue the event goes out.
func TestRelayKeepsUnroutedEventPending(t *testing.T) {
	raw := rabbitURL(t)
	ctx := t.Context()
	pool, cfg := pgtest.Schema(t)
	s, err := table.New(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ad, err := admin.New(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	full, err := cfg.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	table := pgx.Identifier{full.Schema, full.Table}.Sanitize()
	topic := uniqueTopic(t)
	t.Cleanup(func() { deleteQueue(t, raw, topic) })
	pub, err := amqp.New(ctx, amqp.Config{URL: raw, Channels: 4}, &brokers.Routing{Fixed: topic}, nil)
	if err != nil {
		t.Fatal(err)
	}
	r, err := core.New(s, pub, core.Options{PollInterval: 20 * time.Millisecond,
		RetryBackoff: core.Backoff{Min: 50 * time.Millisecond, Max: 200 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	var seq int64
	if err := pool.QueryRow(ctx, `INSERT INTO `+table+` (event_id, aggregate_id, type, payload)
VALUES ($1, 'order-1', 'order.placed', '{"n":1}') RETURNING seq`, uuid.NewString()).Scan(&seq); err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("relay: %v", err)
		}
		_ = pub.Close()
	}()

	row := func() (attempts int, lastError string, dispatched bool) {
		t.Helper()
		if err := pool.QueryRow(ctx, `SELECT attempts, COALESCE(last_error, ''), dispatched_at IS NOT NULL FROM `+table+` WHERE seq = $1`,
			seq).Scan(&attempts, &lastError, &dispatched); err != nil {
			t.Fatal(err)
		}
		return attempts, lastError, dispatched
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		attempts, lastError, dispatched := row()
		if dispatched {
			t.Fatal("the event was marked dispatched though no queue receives it")
		}
		if attempts >= 2 {
			if !strings.Contains(lastError, "no queue is bound") || !strings.Contains(lastError, topic) {
				t.Errorf("last_error %q does not say that no queue is bound to %s", lastError, topic)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 20s: %d attempts, last_error %q; want the publish failed and retried", attempts, lastError)
		}
		time.Sleep(20 * time.Millisecond)
	}
	stuck, err := ad.Stuck(ctx, admin.StuckOptions{OlderThan: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if len(stuck) != 1 || stuck[0].Seq != seq || stuck[0].Held || !strings.Contains(stuck[0].LastError, "no queue is bound") {
		t.Errorf("stuck lists %+v; want event %d, retrying, with its reason", stuck, seq)
	}
	if queueExists(t, raw, topic) {
		t.Errorf("the relay declared queue %s", topic)
	}

	bindQueue(t, raw, topic, topic, topic)
	deadline = time.Now().Add(20 * time.Second)
	for _, _, dispatched := row(); !dispatched; _, _, dispatched = row() {
		if time.Now().After(deadline) {
			t.Fatal("the event was not dispatched within 20s of its queue being bound")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if got := read(t, raw, topic, 1); got[0].Headers[event.HeaderEventSeq] != fmt.Sprint(seq) {
		t.Errorf("delivered %+v, want event %d", got[0], seq)
	}
}
