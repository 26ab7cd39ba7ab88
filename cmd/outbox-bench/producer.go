package main

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/store/walrelay"
)

// closedLoop runs work on n goroutines, back to back, for d, and returns
// how many calls succeeded and their mean duration.
func closedLoop(ctx context.Context, n int, d time.Duration, work func(ctx context.Context, i int64) error) (int64, time.Duration, error) {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	var done, busy atomic.Int64
	var seq atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				t := time.Now()
				if err := work(ctx, seq.Add(1)); err != nil {
					if ctx.Err() == nil {
						errs <- err
						cancel()
					}
					return
				}
				busy.Add(int64(time.Since(t)))
				done.Add(1)
			}
		}()
	}
	wg.Wait()
	select {
	case err := <-errs:
		return 0, 0, err
	default:
	}
	if done.Load() == 0 {
		return 0, 0, nil
	}
	return done.Load(), time.Duration(busy.Load() / done.Load()), nil
}

func aggregateID(i int64, aggregates int) string {
	return fmt.Sprintf("00000000-0000-4000-8000-%012x", i%int64(aggregates))
}

// listener holds a LISTEN on channel and reads notifications, as a relay
// would, so producers pay for signalling a listener too.
func (b *bench) listener(ctx context.Context, channel string) (stop func(), err error) {
	conn, err := pgx.Connect(ctx, b.cfg.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("connect listener: %w", err)
	}
	if _, err := conn.Exec(ctx, "LISTEN "+ident(channel)); err != nil {
		conn.Close(ctx)
		return nil, fmt.Errorf("listen: %w", err)
	}
	lctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			if _, err := conn.WaitForNotification(lctx); err != nil {
				return
			}
		}
	}()
	return func() {
		cancel()
		<-done
		conn.Close(context.WithoutCancel(ctx))
	}, nil
}

// producerPool is sized for the largest number of concurrent producers.
func (b *bench) producerPool(ctx context.Context) (*pgxpool.Pool, error) {
	return openPool(ctx, b.cfg.DatabaseURL, 17, nil)
}

func (b *bench) notifySection(ctx context.Context, rep *report) error {
	cfg, drop, err := b.schema(ctx, "notify")
	if err != nil {
		return err
	}
	defer drop()
	pool, err := b.producerPool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	stop, err := b.listener(ctx, cfg.NotifyChannel)
	if err != nil {
		return err
	}
	defer stop()

	w, err := outbox.NewWriter(outbox.WriterOptions{Store: cfg})
	if err != nil {
		return err
	}
	// The shipped table notifies from a statement-level trigger; the
	// baseline disables it. A producer's own NOTIFY inside its insert
	// statement (as the writer did before migration 4) is the third way.
	table := outboxTable(cfg)
	full, err := cfg.WithDefaults()
	if err != nil {
		return err
	}
	trigger := ident(full.Table + "_notify")
	inline := `WITH ins AS (INSERT INTO ` + table + ` (aggregate_id, type, payload) VALUES ($1, 'bench.event', '{"n":1}') RETURNING 1)
SELECT pg_notify($2, '') FROM (SELECT count(*) FROM ins) AS n`
	write := func(ctx context.Context, tx pgx.Tx, i int64) error {
		return w.Write(ctx, tx, outbox.Message{AggregateID: aggregateID(i, b.cfg.Aggregates), Type: "bench.event", Payload: []byte(`{"n":1}`)})
	}
	variants := []struct {
		name  string
		setup string
		body  func(context.Context, pgx.Tx, int64) error
	}{
		{"no NOTIFY (trigger disabled)", `ALTER TABLE ` + table + ` DISABLE TRIGGER ` + trigger, write},
		{"NOTIFY in the insert statement", "", func(ctx context.Context, tx pgx.Tx, i int64) error {
			_, err := tx.Exec(ctx, inline, aggregateID(i, b.cfg.Aggregates), cfg.NotifyChannel)
			return err
		}},
		{"statement-level AFTER INSERT trigger (shipped)", `ALTER TABLE ` + table + ` ENABLE TRIGGER ` + trigger, write},
	}
	for _, v := range variants {
		if v.setup != "" {
			if _, err := b.pool.Exec(ctx, v.setup); err != nil {
				return fmt.Errorf("set up %s: %w", v.name, err)
			}
		}
		for _, n := range []int{1, 16} {
			b.settle(ctx)
			row, err := b.produce(ctx, pool, n, v.name, v.body)
			if err != nil {
				return err
			}
			rep.Notify = append(rep.Notify, row)
		}
	}
	return nil
}

// produce runs transactions made of body for the configured time.
func (b *bench) produce(ctx context.Context, pool *pgxpool.Pool, n int, name string, body func(context.Context, pgx.Tx, int64) error) (producerRow, error) {
	count, mean, err := closedLoop(ctx, n, b.cfg.ProducerRun, func(ctx context.Context, i int64) error {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return body(ctx, tx, i) })
	})
	if err != nil {
		return producerRow{}, fmt.Errorf("%s with %d producers: %w", name, n, err)
	}
	row := producerRow{Name: name, Producers: n, TxPerSec: float64(count) / b.cfg.ProducerRun.Seconds(), MeanTx: mean}
	b.log.Info("produced", "variant", name, "producers", n, "tx_per_sec", int(row.TxPerSec), "mean", mean)
	return row, nil
}

func (b *bench) producerSection(ctx context.Context, rep *report) error {
	if err := b.notifySection(ctx, rep); err != nil {
		return err
	}
	cfg, drop, err := b.schema(ctx, "producer")
	if err != nil {
		return err
	}
	defer drop()
	orders := ident(cfg.Schema, "orders")
	if _, err := b.pool.Exec(ctx, `CREATE TABLE `+orders+` (
    id         BIGSERIAL PRIMARY KEY,
    customer   UUID NOT NULL,
    amount     NUMERIC(12,2) NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now())`); err != nil {
		return fmt.Errorf("create business table: %w", err)
	}
	pool, err := b.producerPool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	stop, err := b.listener(ctx, cfg.NotifyChannel)
	if err != nil {
		return err
	}
	defer stop()
	w, err := outbox.NewWriter(outbox.WriterOptions{Store: cfg})
	if err != nil {
		return err
	}
	lw, err := outbox.NewLogWriter(outbox.WriterOptions{Store: cfg})
	if err != nil {
		return err
	}
	insert := `INSERT INTO ` + orders + ` (customer, amount) VALUES ($1, $2)`
	business := func(ctx context.Context, tx pgx.Tx, i int64) error {
		_, err := tx.Exec(ctx, insert, aggregateID(i, b.cfg.Aggregates), 42.5)
		return err
	}
	withEvent := func(ctx context.Context, tx pgx.Tx, i int64) error {
		if err := business(ctx, tx, i); err != nil {
			return err
		}
		return w.Write(ctx, tx, outbox.Message{AggregateID: aggregateID(i, b.cfg.Aggregates), Type: "order.placed",
			Payload: []byte(`{"amount":"42.50"}`)})
	}
	// Log-only: the event is a logical decoding message in the WAL, no
	// row (relay.mode log). It needs wal_level=logical, which the
	// baseline then runs under too.
	withLogEvent := func(ctx context.Context, tx pgx.Tx, i int64) error {
		if err := business(ctx, tx, i); err != nil {
			return err
		}
		return lw.Write(ctx, tx, outbox.Message{AggregateID: aggregateID(i, b.cfg.Aggregates), Type: "order.placed",
			Payload: []byte(`{"amount":"42.50"}`)})
	}
	variants := []struct {
		name string
		body func(context.Context, pgx.Tx, int64) error
	}{{"without event", business}, {"with event", withEvent}}
	var level string
	if err := b.pool.QueryRow(ctx, "SHOW wal_level").Scan(&level); err != nil {
		return err
	}
	if level == "logical" {
		// The log write refuses to write while no slot would read it.
		// The slot is not read here: dropped at the end, it keeps WAL
		// only for this section.
		if _, err := walrelay.CreateSlot(ctx, b.pool, cfg, walrelay.Slot{}); err != nil {
			return fmt.Errorf("create slot for the log-only producer: %w", err)
		}
		defer func() {
			if err := walrelay.DropSlot(context.WithoutCancel(ctx), b.pool, cfg, walrelay.Slot{}); err != nil {
				b.log.Warn("drop the log-only producer's slot", "error", err)
			}
		}()
		variants = append(variants, struct {
			name string
			body func(context.Context, pgx.Tx, int64) error
		}{"with log-only event", withLogEvent})
	} else {
		b.log.Warn("wal_level is not logical: the log-only producer is not measured", "wal_level", level)
	}
	for _, n := range []int{1, 16} {
		for _, v := range variants {
			b.settle(ctx)
			row, err := b.produce(ctx, pool, n, v.name, v.body)
			if err != nil {
				return err
			}
			rep.Producer = append(rep.Producer, row)
		}
	}
	return nil
}
