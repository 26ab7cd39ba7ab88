package main

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/core"
)

// payload is what each event carries: its place in its aggregate's
// sequence, which the checker uses to see order.
type payload struct {
	Seq int    `json:"seq"`
	Pad string `json:"pad"`
}

// producerStats are the producers' own counts. Committed counts commits
// PostgreSQL acknowledged; a commit whose acknowledgement was lost may have
// committed too, so the accounting reads the outbox instead.
type producerStats struct {
	committed, rolledBack, uncertain, retries atomic.Int64
	burst                                     atomic.Int64 // committed in bursts

	mu             sync.Mutex
	rolledBackUIDs map[string]bool
}

type producers struct {
	pool       *pgxpool.Pool
	w          *outbox.Writer
	aggregates []string
	target     int64
	rollback   float64
	interval   time.Duration // between transactions of one worker
	more       func() bool   // keeps producing past target while it returns true
	log        *slog.Logger
	stats      *producerStats
}

// run writes events on workers goroutines until target events have
// committed or ctx is done. Each transaction advances one aggregate's
// sequence under its row lock and writes 1 to 3 events for it, so one
// aggregate's events commit in sequence order; a tenth roll back.
func (p *producers) run(ctx context.Context, workers int) {
	var wg sync.WaitGroup
	for i := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.worker(ctx, time.Duration(i)*p.interval/time.Duration(workers))
		}()
	}
	wg.Wait()
}

// worker paces its transactions p.interval apart, starting after offset.
func (p *producers) worker(ctx context.Context, offset time.Duration) {
	next := time.Now().Add(offset)
	failures := 0
	for ctx.Err() == nil && (p.stats.committed.Load() < p.target || (p.more != nil && p.more())) {
		if d := time.Until(next); d > 0 {
			if !sleep(ctx, d) {
				return
			}
		}
		next = next.Add(p.interval)
		if time.Until(next) < -time.Second {
			next = time.Now() // after an outage, do not burst to catch up
		}
		if err := p.random(ctx); err != nil {
			if ctx.Err() != nil {
				return
			}
			p.stats.retries.Add(1)
			failures++
			wait := core.Backoff{Min: 50 * time.Millisecond, Max: time.Second}.Delay(failures - 1)
			if failures == 1 || failures%20 == 0 {
				p.log.Debug("producer transaction failed", "error", err, "failures", failures)
			}
			if !sleep(ctx, wait) {
				return
			}
			continue
		}
		failures = 0
	}
}

var pad = strings.Repeat("x", 120)

// burst commits n events for each of aggs random aggregates, one
// transaction per aggregate, to give the relays long batches to be
// interrupted in. They do not count towards the target. It stops at the
// first error.
func (p *producers) burst(ctx context.Context, aggs, n int) error {
	for range aggs {
		if err := p.transaction(ctx, p.aggregates[rand.N(len(p.aggregates))], n, false); err != nil {
			return err
		}
		p.stats.committed.Add(-int64(n))
		p.stats.burst.Add(int64(n))
	}
	return nil
}

func (p *producers) random(ctx context.Context) error {
	return p.transaction(ctx, p.aggregates[rand.N(len(p.aggregates))], 1+rand.N(3), rand.Float64() < p.rollback)
}

// transaction writes k events for agg and commits, or rolls back.
func (p *producers) transaction(ctx context.Context, agg string, k int, rollback bool) error {
	tx, err := p.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	var seq int
	if err := tx.QueryRow(ctx, "UPDATE chaos.aggregates SET seq = seq + $2 WHERE id = $1 RETURNING seq", agg, k).Scan(&seq); err != nil {
		return fmt.Errorf("advance aggregate: %w", err)
	}
	msgs := make([]outbox.Message, k)
	uids := make([]string, k)
	for i := range msgs {
		id, err := uuid.NewV7()
		if err != nil {
			return err
		}
		uids[i] = id.String()
		msgs[i] = outbox.Message{AggregateID: agg, Type: "order.updated", ID: uids[i],
			Payload: payload{Seq: seq - k + 1 + i, Pad: pad}}
	}
	if err := p.w.Write(ctx, tx, msgs...); err != nil {
		return fmt.Errorf("write events: %w", err)
	}
	if rollback {
		if err := tx.Rollback(ctx); err != nil {
			return fmt.Errorf("roll back: %w", err)
		}
		p.stats.rolledBack.Add(int64(k))
		p.stats.mu.Lock()
		for _, u := range uids {
			p.stats.rolledBackUIDs[u] = true
		}
		p.stats.mu.Unlock()
		return nil
	}
	if err := tx.Commit(ctx); err != nil {
		p.stats.uncertain.Add(int64(k))
		return fmt.Errorf("commit: %w", err)
	}
	p.stats.committed.Add(int64(k))
	return nil
}

// sleep waits d; false when ctx ended first.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
