package migrate_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/migrate"
)

// Upgrading a large outbox from every earlier version does not stop the
// producers: while the migrations run, a producer inserting 50 events a
// second in the schema of the version upgraded from never waits more than
// a second for an INSERT.
//
// The bound: every statement that takes a lock blocking INSERT runs under
// a lock_timeout of 500ms (retried after a pause in which producers go on)
// and holds it for a catalog change only, milliseconds; an INSERT waits at
// most for the timeout plus that change. A second leaves room for a loaded
// two-core machine. Before this runner, migration 7 rewrote the table
// under an exclusive lock and producers waited for the whole rewrite.
//
// In `make test` the table has 300,000 rows when upgraded from version 6
// (migration 7, which rewrote the table before, fills a new column in
// every row) and 50,000 from the other versions, to keep the test near a
// minute on a two-core machine: the locks taken do not depend on the size,
// the wait a lock would cause does. OUTBOX_TEST_MIGRATE_ROWS sets the size
// for every version: a million rows from each takes about twenty minutes.
func TestMigrateLargeTableWhileProducing(t *testing.T) {
	if testing.Short() {
		t.Skip("fills tables of a million rows")
	}
	rows := func(v int) int {
		if v == 6 {
			return 300_000
		}
		return 50_000
	}
	if s := os.Getenv("OUTBOX_TEST_MIGRATE_ROWS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			t.Fatalf("OUTBOX_TEST_MIGRATE_ROWS=%q: want a positive number of rows", s)
		}
		rows = func(int) int { return n }
	}
	for v := 1; v <= 7; v++ {
		t.Run(fmt.Sprintf("from_%d", v), func(t *testing.T) {
			ctx := context.Background()
			pool, cfg := upgradeFrom(t, v)
			n := rows(v)
			start := time.Now()
			fillAsVersion(ctx, t, pool, cfg, v, n)
			filled := time.Since(start)

			pctx, stop := context.WithCancel(ctx)
			prod := startProducer(pctx, pool, cfg, v)
			time.Sleep(300 * time.Millisecond) // the producer is running before the migration starts
			start = time.Now()
			applied, err := migrate.MigrateWith(ctx, pool, cfg, migrate.Options{Log: slog.New(slog.NewTextHandler(testWriter{t}, nil))})
			took := time.Since(start)
			time.Sleep(300 * time.Millisecond) // and after it ends
			stop()
			res := prod.wait()
			if err != nil {
				t.Fatalf("migrate from %d: %v", v, err)
			}
			if len(applied) == 0 {
				t.Fatalf("migrate from %d applied nothing", v)
			}
			t.Logf("from version %d, %d rows (filled in %v): migrated %v in %v; %d inserts, max wait %v, %d failed",
				v, n, filled.Round(time.Millisecond), applied, took.Round(time.Millisecond), res.inserts, res.max.Round(time.Millisecond), len(res.errs))
			for _, e := range res.errs {
				t.Errorf("producer insert: %v", e)
			}
			if res.inserts < int(took.Seconds()*25) {
				t.Errorf("%d inserts in %v, want about 50 a second", res.inserts, took)
			}
			if res.max > time.Second {
				t.Errorf("a producer insert waited %v during the migration, want at most 1s", res.max)
			}
			if err := migrate.CheckSchema(ctx, pool, cfg); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// fillAsVersion fills the outbox at version v with n rows, mostly
// dispatched and kept for retention, as that version's relay left them.
func fillAsVersion(ctx context.Context, t *testing.T, pool *pgxpool.Pool, cfg store.Config, v, n int) {
	t.Helper()
	idCol := "event_id"
	if v < 5 {
		idCol = "uid"
	}
	table := ident(cfg)
	q := `INSERT INTO ` + table + ` (` + idCol + `, aggregate_id, type, payload, headers, dispatched_at)
SELECT gen_random_uuid(), gen_random_uuid(), 'order.placed', '{"order":12345,"lines":[1,2,3],"total":"99.50"}',
       '{"traceparent":"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}',
       CASE WHEN i <= $1 - 1000 THEN now() END
FROM generate_series(1, $1) AS i`
	if _, err := pool.Exec(ctx, q, n); err != nil {
		t.Fatalf("fill %d rows at version %d: %v", n, v, err)
	}
	// A table in steady state has been vacuumed: autovacuum would
	// otherwise run through the migration.
	if _, err := pool.Exec(ctx, "VACUUM ANALYZE "+table); err != nil {
		t.Fatal(err)
	}
}

// testWriter writes a log line to the test's log.
type testWriter struct{ t *testing.T }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(b), "\n"))
	return len(b), nil
}

type producerResult struct {
	inserts int
	max     time.Duration
	errs    []error
}

type producer struct {
	done chan producerResult
}

func (p producer) wait() producerResult { return <-p.done }

// startProducer inserts an event every 20ms as a producer of version v
// would: before migration 4 it must name the uid, which migration 5
// renames; a producer that meets the renamed column goes on with the
// columns of today, as a redeployed one would, and that retry counts in
// the wait of its insert.
func startProducer(ctx context.Context, pool *pgxpool.Pool, cfg store.Config, v int) producer {
	table := ident(cfg)
	current := `INSERT INTO ` + table + ` (aggregate_id, type, payload) VALUES ($1, 'order.placed', '{"order":1}')`
	q := current
	if v < 4 {
		q = `INSERT INTO ` + table + ` (uid, aggregate_id, type, payload) VALUES (gen_random_uuid(), $1, 'order.placed', '{"order":1}')`
	}
	p := producer{done: make(chan producerResult, 1)}
	go func() {
		var res producerResult
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				p.done <- res
				return
			case <-tick.C:
			}
			start := time.Now()
			ictx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			_, err := pool.Exec(ictx, q, uuid.NewString())
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "42703" && q != current { // undefined_column
				q = current
				_, err = pool.Exec(ictx, q, uuid.NewString())
			}
			cancel()
			d := time.Since(start)
			if err != nil {
				res.errs = append(res.errs, err)
				continue
			}
			res.inserts++
			res.max = max(res.max, d)
		}
	}()
	return p
}
