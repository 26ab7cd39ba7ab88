package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/logrelay"
	tablesrc "github.com/outboxhq/outbox/store/table"
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

// keepBest adds row to rows, or raises the row of the same variant and
// producers to it when row is faster.
func keepBest(rows *[]producerRow, row producerRow) {
	for i, r := range *rows {
		if r.Section == row.Section && r.Name == row.Name && r.Producers == row.Producers {
			if row.TxPerSec > r.TxPerSec {
				(*rows)[i] = row
			}
			return
		}
	}
	*rows = append(*rows, row)
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
	// The baseline is a transaction of two business rows, an order and
	// its line; the variants replace the line with the event.
	orders, lines := ident(cfg.Schema, "orders"), ident(cfg.Schema, "order_lines")
	if _, err := b.pool.Exec(ctx, `CREATE TABLE `+orders+` (
    id         BIGSERIAL PRIMARY KEY,
    customer   UUID NOT NULL,
    amount     NUMERIC(12,2) NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now());
CREATE TABLE `+lines+` (
    id       BIGSERIAL PRIMARY KEY,
    order_id BIGINT NOT NULL,
    sku      TEXT NOT NULL,
    qty      INT NOT NULL)`); err != nil {
		return fmt.Errorf("create business tables: %w", err)
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
	insertLine := `INSERT INTO ` + lines + ` (order_id, sku, qty) VALUES (lastval(), 'sku-1', 1)`
	twoRows := func(ctx context.Context, tx pgx.Tx, i int64) error {
		if err := business(ctx, tx, i); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, insertLine)
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
	}{{nameTwoRows, twoRows}, {nameWithEvent, withEvent}}
	var level string
	if err := b.pool.QueryRow(ctx, "SHOW wal_level").Scan(&level); err != nil {
		return err
	}
	if level == "logical" {
		// The log write refuses to write while no slot would read it.
		// The slot is not read here: dropped at the end, it keeps WAL
		// only for this section.
		if _, err := logrelay.CreateSlot(ctx, b.pool, cfg, logrelay.Slot{}); err != nil {
			return fmt.Errorf("create slot for the log-only producer: %w", err)
		}
		defer func() {
			if err := logrelay.DropSlot(context.WithoutCancel(ctx), b.pool, cfg, logrelay.Slot{}); err != nil {
				b.log.Warn("drop the log-only producer's slot", "error", err)
			}
		}()
		variants = append(variants, struct {
			name string
			body func(context.Context, pgx.Tx, int64) error
		}{nameWithLogEvent, withLogEvent})
	} else {
		b.log.Warn("wal_level is not logical: the log-only producer is not measured", "wal_level", level)
	}
	// Interleaved rounds, the best of each kept: the host's noise then
	// weighs on a baseline and its variant alike.
	for range b.cfg.Repeat {
		for _, n := range []int{1, 16} {
			for _, v := range variants {
				b.settle(ctx)
				row, err := b.produce(ctx, pool, n, v.name, v.body)
				if err != nil {
					return err
				}
				keepBest(&rep.Producer, row)
			}
		}
	}
	return b.pgbenchSection(ctx, rep, cfg, orders, lines)
}

// Names of the producer variants the goals compare.
const (
	nameTwoRows         = "two business rows (order, order line)"
	nameWithEvent       = "order + event (Go writer)"
	nameWithLogEvent    = "order + log-only event (Go writer)"
	nameSQLTwoRows      = "two business rows, plain SQL (pgbench)"
	nameSQLWithEvent    = "order + event, plain SQL INSERT (pgbench)"
	nameSQLEventDrained = "order + event, plain SQL INSERT, a relay draining (pgbench)"
)

// pgbenchTPS finds the transactions per second in pgbench's report.
var pgbenchTPS = regexp.MustCompile(`(?m)^tps = ([0-9.]+)`)

// pgbenchSection runs the same comparison as plain SQL through pgbench,
// as a service in any language writes: an order and its line, then an
// order and an outbox row. No relay runs, as in PostgreSQL's own
// benchmarks; a last row has a relay draining the outbox meanwhile, so
// producers pay for the wake-ups a relay that catches up asks for.
func (b *bench) pgbenchSection(ctx context.Context, rep *report, cfg store.Config, orders, lines string) error {
	bin, err := exec.LookPath(filepath.Join(os.Getenv("OUTBOX_TEST_PG_BIN"), "pgbench"))
	if err != nil {
		if bin, err = exec.LookPath("pgbench"); err != nil {
			b.log.Warn("pgbench not found: the plain SQL producer comparison is not measured")
			return nil
		}
	}
	dir, err := os.MkdirTemp("", "outbox-pgbench")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	scripts := map[string]string{
		nameSQLTwoRows: `\set c random(1, 100000)
BEGIN;
INSERT INTO ` + orders + ` (customer, amount) VALUES (gen_random_uuid(), 42.5);
INSERT INTO ` + lines + ` (order_id, sku, qty) VALUES (lastval(), 'sku-1', 1);
END;
`,
		nameSQLWithEvent: `\set c random(1, 100000)
BEGIN;
INSERT INTO ` + orders + ` (customer, amount) VALUES (gen_random_uuid(), 42.5);
INSERT INTO ` + outboxTable(cfg) + ` (aggregate_id, type, payload) VALUES (:c, 'order.placed', '{"amount":"42.50"}');
END;
`,
	}
	files := map[string]string{}
	for i, name := range []string{nameSQLTwoRows, nameSQLWithEvent} {
		files[name] = filepath.Join(dir, fmt.Sprintf("%d.sql", i))
		if err := os.WriteFile(files[name], []byte(scripts[name]), 0o600); err != nil {
			return err
		}
	}
	files[nameSQLEventDrained] = files[nameSQLWithEvent]
	run := func(name string, clients int) error {
		file := files[name]
		b.settle(ctx)
		secs := max(1, int(b.cfg.ProducerRun.Seconds()))
		out, err := exec.CommandContext(ctx, bin, "-n", "-T", fmt.Sprint(secs), "-c", fmt.Sprint(clients), "-j", fmt.Sprint(clients),
			"-f", file, b.cfg.DatabaseURL).CombinedOutput()
		if err != nil {
			return fmt.Errorf("pgbench %s: %w: %s", name, err, out)
		}
		m := pgbenchTPS.FindSubmatch(out)
		if m == nil {
			return fmt.Errorf("pgbench %s: no tps in its output: %s", name, out)
		}
		tps, _ := strconv.ParseFloat(string(m[1]), 64)
		b.log.Info("produced", "variant", name, "producers", clients, "tx_per_sec", int(tps))
		keepBest(&rep.Producer, producerRow{Name: name, Producers: clients, TxPerSec: tps,
			MeanTx: time.Duration(float64(clients) / tps * float64(time.Second))})
		return nil
	}
	for range b.cfg.Repeat {
		for _, n := range []int{1, 16} {
			for _, name := range []string{nameSQLTwoRows, nameSQLWithEvent} {
				if err := run(name, n); err != nil {
					return err
				}
			}
		}
	}
	st, err := tablesrc.New(b.pool, cfg, b.log)
	if err != nil {
		return err
	}
	var drained counter
	relay, err := core.New(st, &drained, b.relayOptions(false, nil))
	if err != nil {
		return err
	}
	if err := relay.Start(ctx); err != nil {
		return err
	}
	err = run(nameSQLEventDrained, 16)
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	if serr := relay.Stop(sctx); err == nil {
		err = serr
	}
	return err
}
