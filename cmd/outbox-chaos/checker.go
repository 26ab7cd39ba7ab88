package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
	"github.com/outboxhq/outbox/dedupe"
)

// tally is what the checker saw. Order is judged on first receipts: an
// event seen for the first time after a later event of its aggregate is a
// violation; a redelivery of an old event is only a duplicate.
type tally struct {
	mu         sync.Mutex
	receipts   int
	seen       map[string]bool // event uid
	maxSeq     map[string]int  // aggregate -> highest sequence number seen
	violations int
	noIdentity int
	examples   []string
}

func newTally() *tally {
	return &tally{seen: map[string]bool{}, maxSeq: map[string]int{}}
}

func (t *tally) record(uid, agg string, seq int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.receipts++
	if t.seen[uid] {
		return
	}
	t.seen[uid] = true
	if m := t.maxSeq[agg]; seq < m {
		t.violations++
		if len(t.examples) < 5 {
			t.examples = append(t.examples, fmt.Sprintf("aggregate %s: seq %d first seen after seq %d", agg, seq, m))
		}
	} else {
		t.maxSeq[agg] = seq
	}
}

// account fills in rep what the tally says against the committed events
// (uid -> true) and those of rolled-back transactions.
func (t *tally) account(rep *Report, committed, rolledBack map[string]bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	rep.Delivered, rep.Receipts = len(t.seen), t.receipts
	rep.Duplicates = t.receipts - len(t.seen)
	rep.OrderViolations, rep.NoIdentity = t.violations, t.noIdentity
	rep.Examples = append(rep.Examples, t.examples...)
	for uid := range committed {
		if !t.seen[uid] {
			rep.Lost++
			if rep.Lost <= 5 {
				rep.Examples = append(rep.Examples, "lost: "+uid)
			}
		}
	}
	for uid := range t.seen {
		if !committed[uid] {
			rep.Phantom++
			if rolledBack[uid] {
				rep.RolledBackDelivered++
			}
		}
	}
}

// duplicates counts the receipts of events received before.
func (t *tally) duplicates() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.receipts - len(t.seen)
}

func (t *tally) unique() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.seen)
}

// checker applies each delivered event's effect through the deduper, then
// records it. A failure (the database down) is retried in place, with
// backoff, so the broker's order is kept and nothing is skipped.
type checker struct {
	d       *dedupe.Deduper[pgx.Tx]
	t       *tally
	log     *slog.Logger
	retries atomic.Int64
	// reconnects counts broker connections lost and made again.
	reconnects atomic.Int64
}

const effectSQL = `INSERT INTO chaos.effects (uid, aggregate_id, seq, applied) VALUES ($1, $2, $3, 1)
ON CONFLICT (uid) DO UPDATE SET applied = effects.applied + 1`

// handle processes one message until it succeeds or ctx ends; it returns
// false when it gave up because ctx ended.
func (c *checker) handle(ctx context.Context, headers map[string]string, body []byte) bool {
	uid, agg := headers[event.HeaderEventID], headers[event.HeaderAggregateID]
	var p payload
	if uid == "" || agg == "" || json.Unmarshal(body, &p) != nil {
		c.t.mu.Lock()
		c.t.noIdentity++
		c.t.mu.Unlock()
		return true // a real consumer would dead-letter it; it must not happen here
	}
	for failures := 0; ; failures++ {
		_, err := c.d.Process(ctx, uid, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, effectSQL, uid, agg, p.Seq)
			return err
		})
		if err == nil {
			c.t.record(uid, agg, p.Seq)
			return true
		}
		if ctx.Err() != nil {
			return false
		}
		c.retries.Add(1)
		if failures == 0 {
			c.log.Debug("consumer could not apply an event; retrying", "event_uid", uid, "error", err)
		}
		if !sleep(ctx, core.Backoff{Min: 50 * time.Millisecond, Max: 2 * time.Second}.Delay(failures)) {
			return false
		}
	}
}

// consumeAMQP reads queue until ctx ends, reconnecting after the broker
// goes away. Messages are acknowledged after their effect committed, so a
// lost connection redelivers, never drops.
func (c *checker) consumeAMQP(ctx context.Context, url, queue string) {
	for failures := 0; ctx.Err() == nil; {
		started := time.Now()
		err := c.consumeAMQPOnce(ctx, url, queue)
		if ctx.Err() != nil {
			return
		}
		c.reconnects.Add(1)
		if time.Since(started) > 10*time.Second {
			failures = 0
		}
		wait := core.Backoff{Min: 100 * time.Millisecond, Max: 3 * time.Second}.Delay(failures)
		failures++
		c.log.Debug("consumer lost the broker; reconnecting", "error", err, "in", wait)
		if !sleep(ctx, wait) {
			return
		}
	}
}

func (c *checker) consumeAMQPOnce(ctx context.Context, url, queue string) error {
	conn, err := amqp091.DialConfig(url, amqp091.Config{Dial: amqp091.DefaultDial(5 * time.Second), Heartbeat: 5 * time.Second})
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	if err := ch.Qos(256, 0, false); err != nil {
		return fmt.Errorf("set prefetch: %w", err)
	}
	if err := declareQueue(ch, queue); err != nil {
		return err
	}
	deliveries, err := ch.ConsumeWithContext(ctx, queue, "", false, false, false, false, nil)
	if err != nil {
		return fmt.Errorf("consume %s: %w", queue, err)
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case d, ok := <-deliveries:
			if !ok {
				return errors.New("deliveries stopped")
			}
			headers := map[string]string{}
			for k, v := range d.Headers {
				if s, ok := v.(string); ok {
					headers[k] = s
				}
			}
			if !c.handle(ctx, headers, d.Body) {
				return nil
			}
			if err := d.Ack(false); err != nil {
				return fmt.Errorf("ack: %w", err)
			}
		}
	}
}

// declareQueue declares the queue as the amqp broker adapter does (durable,
// bound to the topic's exchange with the topic as key), so the checker can
// listen before the first event is published.
func declareQueue(ch *amqp091.Channel, topic string) error {
	if err := ch.ExchangeDeclare(topic, "topic", true, false, false, false, nil); err != nil {
		return fmt.Errorf("declare exchange %s: %w", topic, err)
	}
	if _, err := ch.QueueDeclare(topic, true, false, false, false, nil); err != nil {
		return fmt.Errorf("declare queue %s: %w", topic, err)
	}
	if err := ch.QueueBind(topic, topic, topic, false, nil); err != nil {
		return fmt.Errorf("bind queue %s: %w", topic, err)
	}
	return nil
}

// consumeKafka reads every partition of topic from the start until ctx
// ends, one record at a time in partition order. It reads committed
// records only (read_committed), as a consumer of the exactly-once path
// must; without transactions that is every record.
func (c *checker) consumeKafka(ctx context.Context, brokers []string, topic string) error {
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchIsolationLevel(kgo.ReadCommitted()))
	if err != nil {
		return fmt.Errorf("kafka consumer: %w", err)
	}
	defer cl.Close()
	for ctx.Err() == nil {
		fetches := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			return nil
		}
		fetches.EachError(func(t string, p int32, err error) {
			c.log.Debug("kafka fetch error", "topic", t, "partition", p, "error", err)
		})
		stopped := false
		fetches.EachRecord(func(r *kgo.Record) {
			if stopped {
				return
			}
			headers := make(map[string]string, len(r.Headers))
			for _, h := range r.Headers {
				headers[h.Key] = string(h.Value)
			}
			stopped = !c.handle(ctx, headers, r.Value)
		})
	}
	return nil
}
