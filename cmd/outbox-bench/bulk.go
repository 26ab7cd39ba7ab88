package main

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/migrate"
	tablesrc "github.com/outboxhq/outbox/store/table"
)

// The producers section: events per transaction against plain inserts of
// the same rows, and what migration 7 (text keys, payload bytes, topic,
// deliver-at, their checks and trigger) costs the producer and the claim.

type bulkRow struct {
	Name         string
	PerTx        int
	EventsPerSec float64
	MeanTx       time.Duration
}

type claimRow struct {
	Name     string
	Backlog  int
	P50, P90 time.Duration
}

func (b *bench) producersSection(ctx context.Context, rep *report) error {
	if err := b.bulkSection(ctx, rep); err != nil {
		return err
	}
	return b.migration7Section(ctx, rep)
}

func (b *bench) bulkSection(ctx context.Context, rep *report) error {
	cfg, drop, err := b.schema(ctx, "bulk")
	if err != nil {
		return err
	}
	defer drop()
	pool, err := b.producerPool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	w, err := outbox.NewWriter(outbox.WriterOptions{Store: cfg})
	if err != nil {
		return err
	}
	table := outboxTable(cfg)
	plain := `INSERT INTO ` + table + ` (aggregate_id, type, payload) VALUES ($1, 'order.placed', $2)`
	msgs := func(i int64, n int) []outbox.Message {
		m := make([]outbox.Message, n)
		for j := range m {
			m[j] = outbox.Message{AggregateID: "ord_" + strconv.FormatInt((i*int64(n)+int64(j))%int64(b.cfg.Aggregates), 36),
				Type: "order.placed", Payload: []byte(`{"amount":"42.50"}`)}
		}
		return m
	}
	for _, n := range []int{1, 10, 100, 1000} {
		variants := []struct {
			name string
			tx   func(ctx context.Context, i int64) error
		}{
			{"Writer.Write (pgx), one statement", func(ctx context.Context, i int64) error {
				return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return w.Write(ctx, tx, msgs(i, n)...) })
			}},
			{"Writer.WriteSQL (database/sql on pgx stdlib), one statement", func(ctx context.Context, i int64) error {
				tx, err := db.BeginTx(ctx, nil)
				if err != nil {
					return err
				}
				if err := w.WriteSQL(ctx, tx, msgs(i, n)...); err != nil {
					_ = tx.Rollback()
					return err
				}
				return tx.Commit()
			}},
			{"plain INSERT per row, same rows", func(ctx context.Context, i int64) error {
				return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					for _, m := range msgs(i, n) {
						if _, err := tx.Exec(ctx, plain, m.AggregateID, string(m.Payload.([]byte))); err != nil {
							return err
						}
					}
					return nil
				})
			}},
		}
		if n <= 100 {
			variants = append(variants, struct {
				name string
				tx   func(ctx context.Context, i int64) error
			}{"SQL write function per row", func(ctx context.Context, i int64) error {
				return sqlFuncTx(ctx, db, cfg, msgs(i, n))
			}})
		}
		for _, v := range variants {
			b.settle(ctx)
			count, mean, err := closedLoop(ctx, 1, b.cfg.ProducerRun, v.tx)
			if err != nil {
				return fmt.Errorf("%s, %d per transaction: %w", v.name, n, err)
			}
			row := bulkRow{Name: v.name, PerTx: n, EventsPerSec: float64(count) * float64(n) / b.cfg.ProducerRun.Seconds(), MeanTx: mean}
			b.log.Info("bulk", "variant", v.name, "per_tx", n, "events_per_sec", int(row.EventsPerSec))
			rep.Bulk = append(rep.Bulk, row)
		}
	}
	return nil
}

func sqlFuncTx(ctx context.Context, db *sql.DB, cfg store.Config, msgs []outbox.Message) error {
	full, _ := cfg.WithDefaults()
	q := `SELECT ` + ident(full.Schema, full.Table+"_write") + `($1, $2, $3::text)`
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	for _, m := range msgs {
		if _, err := tx.ExecContext(ctx, q, m.AggregateID, m.Type, string(m.Payload.([]byte))); err != nil {
			_ = tx.Rollback()
			return err
		}
	}
	return tx.Commit()
}

// migration7Section measures one table before and after migration 7: the
// writer's transaction (migration 6's statement on the uuid column against
// today's) and the ordered claim on the same backlog, with and without
// scheduled events waiting in it.
func (b *bench) migration7Section(ctx context.Context, rep *report) error {
	b.seq++
	cfg, err := store.Config{Schema: fmt.Sprintf("bench_m7_%d", b.seq)}.WithDefaults()
	if err != nil {
		return err
	}
	cfg.NotifyChannel = cfg.Schema
	q := ident(cfg.Schema)
	defer func() { _, _ = b.pool.Exec(context.WithoutCancel(ctx), "DROP SCHEMA IF EXISTS "+q+" CASCADE") }()
	if _, err := b.pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+q+" CASCADE"); err != nil {
		return err
	}
	if _, err := migrate.MigrateWith(ctx, b.pool, cfg, migrate.Options{To: 6}); err != nil {
		return err
	}
	table := outboxTable(cfg)
	pool, err := b.producerPool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	beforeInsert := `INSERT INTO ` + table + ` (event_id, aggregate_id, type, payload, headers)
SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::text[]::json[], $5::text[]::jsonb[])`
	produce := func(name string, write func(ctx context.Context, tx pgx.Tx, i int64, n int) error) error {
		for _, n := range []int{1, 100} {
			b.settle(ctx)
			count, mean, err := closedLoop(ctx, 1, b.cfg.ProducerRun, func(ctx context.Context, i int64) error {
				return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return write(ctx, tx, i, n) })
			})
			if err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			rep.Migration7 = append(rep.Migration7, bulkRow{Name: name, PerTx: n, EventsPerSec: float64(count) * float64(n) / b.cfg.ProducerRun.Seconds(), MeanTx: mean})
		}
		return nil
	}
	err = produce("migration 6 table (uuid key), its insert", func(ctx context.Context, tx pgx.Tx, i int64, n int) error {
		ids, aggs, types, payloads := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
		for j := range n {
			ids[j] = uuid.NewString()
			aggs[j] = aggregateID(i*int64(n)+int64(j), b.cfg.Aggregates)
			types[j], payloads[j] = "order.placed", `{"amount":"42.50"}`
		}
		_, err := tx.Exec(ctx, beforeInsert, ids, aggs, types, payloads, make([]*string, n))
		return err
	})
	if err != nil {
		return err
	}
	truncate := func() error {
		_, err := b.pool.Exec(ctx, "TRUNCATE "+table)
		return err
	}
	if err := truncate(); err != nil {
		return err
	}
	before := claimBefore(table)
	claimB, err := b.claimTimes(ctx, "migration 6 (uuid key)", func(ctx context.Context, tx pgx.Tx) error {
		rows, err := tx.Query(ctx, before, b.batchSize(), store.DefaultMaxEventBytes, store.DefaultMaxClaimBytes)
		if err != nil {
			return err
		}
		rows.Close()
		return rows.Err()
	}, cfg)
	if err != nil {
		return err
	}
	rep.Claims = append(rep.Claims, claimB)

	// Migrate in place, the backlog with it, and claim the same rows again.
	start := time.Now()
	if _, err := migrate.MigrateWith(ctx, b.pool, cfg, migrate.Options{To: 7}); err != nil {
		return fmt.Errorf("apply migration 7: %w", err)
	}
	rep.Migration7Took = time.Since(start)
	b.log.Info("migration 7 applied", "backlog", claimB.Backlog, "took", rep.Migration7Took)
	st, err := tablesrc.New(b.pool, cfg, nil)
	if err != nil {
		return err
	}
	viaStore := func(ctx context.Context, _ pgx.Tx) error {
		c, err := st.Claim(ctx, core.ClaimOptions{Limit: b.batchSize()})
		if err != nil {
			return err
		}
		return c.Release(ctx)
	}
	claimA, err := b.claimTimes(ctx, "migration 7 (text key, new columns)", viaStore, cfg)
	if err != nil {
		return err
	}
	rep.Claims = append(rep.Claims, claimA)
	// Scheduled events a day away, written before the backlog: each
	// ordered claim steps over them and holds their aggregates out.
	if err := truncate(); err != nil {
		return err
	}
	if _, err := b.pool.Exec(ctx, `INSERT INTO `+table+` (aggregate_id, type, payload, deliver_at)
SELECT 'scheduled-' || g, 'reminder.due', '{}', now() + interval '1 day' FROM generate_series(1, 10000) g`); err != nil {
		return err
	}
	claimS, err := b.claimTimes(ctx, "migration 7, 10,000 scheduled events waiting ahead", viaStore, cfg)
	if err != nil {
		return err
	}
	rep.Claims = append(rep.Claims, claimS)

	if err := truncate(); err != nil {
		return err
	}
	w, err := outbox.NewWriter(outbox.WriterOptions{Store: cfg})
	if err != nil {
		return err
	}
	return produce("migration 7 table (text key, checks, trigger), Writer.Write", func(ctx context.Context, tx pgx.Tx, i int64, n int) error {
		m := make([]outbox.Message, n)
		for j := range m {
			m[j] = outbox.Message{AggregateID: aggregateID(i*int64(n)+int64(j), b.cfg.Aggregates), Type: "order.placed", Payload: []byte(`{"amount":"42.50"}`)}
		}
		return w.Write(ctx, tx, m...)
	})
}

// claimTimes fills cfg's outbox with a backlog (kept between calls: a
// claim that is released leaves it as it was) and times 30 claims.
func (b *bench) claimTimes(ctx context.Context, name string, claim func(ctx context.Context, tx pgx.Tx) error, cfg store.Config) (claimRow, error) {
	backlog := 100_000
	if b.cfg.Quick {
		backlog = 20_000
	}
	var n int
	if err := b.pool.QueryRow(ctx, "SELECT count(*) FROM "+outboxTable(cfg)+" WHERE type = 'bench.event'").Scan(&n); err != nil {
		return claimRow{}, err
	}
	if n == 0 {
		if err := b.fill(ctx, cfg, backlog); err != nil {
			return claimRow{}, err
		}
	} else if _, err := b.pool.Exec(ctx, "VACUUM ANALYZE "+outboxTable(cfg)); err != nil {
		return claimRow{}, err
	}
	var times []time.Duration
	for range 30 {
		start := time.Now()
		err := pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
			if err := claim(ctx, tx); err != nil {
				return err
			}
			return errRollback
		})
		if err != nil && err != errRollback {
			return claimRow{}, fmt.Errorf("claim %s: %w", name, err)
		}
		times = append(times, time.Since(start))
	}
	slices.Sort(times)
	row := claimRow{Name: name, Backlog: backlog, P50: times[len(times)/2], P90: times[len(times)*9/10]}
	b.log.Info("claim", "variant", name, "p50", row.P50, "p90", row.P90)
	return row, nil
}

var errRollback = fmt.Errorf("roll back")

// claimBefore is the ordered claim as migration 6's table had it, for the
// comparison.
func claimBefore(t string) string {
	cols := "seq, event_id::text AS event_id, aggregate_id, type, payload, headers, created_at, attempts," +
		" octet_length(payload::text) + coalesce(octet_length(headers::text), 0) AS size"
	within := `(w.total <= $3 OR w.total = c.size)`
	return `
WITH held AS (
    SELECT DISTINCT aggregate_id FROM ` + t + `
    WHERE dispatched_at IS NULL AND parked_at IS NULL AND retry_at IS NOT NULL AND retry_at > now()
), cand AS MATERIALIZED (
    SELECT ` + cols + ` FROM ` + t + `
    WHERE dispatched_at IS NULL AND parked_at IS NULL AND (retry_at IS NULL OR retry_at <= now())
      AND aggregate_id NOT IN (SELECT aggregate_id FROM held)
    ORDER BY seq LIMIT $1
    FOR UPDATE SKIP LOCKED
), gate AS MATERIALIZED (
    SELECT a.aggregate_id, (
        SELECT p.seq FROM ` + t + ` p
        WHERE p.aggregate_id = a.aggregate_id AND p.dispatched_at IS NULL AND p.parked_at IS NULL
          AND p.seq NOT IN (SELECT seq FROM cand)
        ORDER BY p.seq LIMIT 1
    ) AS first_out
    FROM (SELECT DISTINCT aggregate_id FROM cand) a
), w AS (SELECT seq, sum(CASE WHEN size <= $2 THEN size ELSE 0 END) OVER (ORDER BY seq) AS total FROM cand)
SELECT c.seq, c.event_id, c.aggregate_id::text, c.type,
       CASE WHEN c.size <= $2 AND ` + within + ` THEN c.payload::text END,
       c.headers::text, c.created_at, c.attempts, c.size, ` + within + `,
       g.first_out IS NULL OR c.seq < g.first_out
FROM cand c JOIN gate g ON g.aggregate_id = c.aggregate_id JOIN w ON w.seq = c.seq
ORDER BY c.seq`
}
