package console_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/cmd/outbox/console"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store/admin"
)

// BenchmarkConsolePages measures each page and API call, served over HTTP
// from a real PostgreSQL, over an outbox table of a million events
// (OUTBOX_SCALE_ROWS changes the size): dispatched events over a week, the
// last hour's at 100 per second, and a backlog of pending, held,
// backing-off and parked ones. docs/operations.md reports the figures:
//
//	go test -run '^$' -bench ConsolePages -benchtime 20x ./cmd/outbox/console/
func BenchmarkConsolePages(b *testing.B) {
	srv, ids := scaleTable(b)
	get := func(b *testing.B, path string) {
		req, _ := http.NewRequest(http.MethodGet, srv.URL+path, nil)
		req.SetBasicAuth(testUser, testPass)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			b.Fatalf("GET %s: %d %s", path, resp.StatusCode, body)
		}
	}
	for _, p := range []struct{ name, path string }{
		{"overview", "/console/"},
		{"overview-api", "/api/v1/overview"},
		{"stuck", "/console/events?state=stuck"},
		{"held", "/console/events?state=held"},
		{"retrying", "/console/events?state=retrying"},
		{"pending", "/console/events?state=pending"},
		{"pending-by-type", "/console/events?state=pending&type=invoice.sent"},
		{"parked", "/console/events?state=parked"},
		{"dispatched", "/console/events?state=dispatched"},
		{"dispatched-page-100", fmt.Sprintf("/console/events?state=dispatched&after=%d", ids.dispatched)},
		{"event-held", fmt.Sprintf("/console/events/%d", ids.held)},
		{"event-dispatched", fmt.Sprintf("/console/events/%d", ids.dispatched)},
		{"failures", "/console/failures"},
		{"confirm-retry-by-type", "/console/actions/retry?type=order.placed"},
	} {
		b.Run(p.name, func(b *testing.B) {
			get(b, p.path) // warm the plan and the cache
			start := time.Now()
			for b.Loop() {
				get(b, p.path)
			}
			b.ReportMetric(float64(time.Since(start).Microseconds())/1000/float64(b.N), "ms/page")
		})
	}
}

type scaleIDs struct{ held, dispatched int64 }

var (
	scaleOnce sync.Once
	scaleSrv  *httptest.Server
	scaleRef  scaleIDs
	scaleErr  error
)

// scaleTable builds the table once per process; sub-benchmarks share it.
func scaleTable(b *testing.B) (*httptest.Server, scaleIDs) {
	b.Helper()
	rows := 1_000_000
	if v := os.Getenv("OUTBOX_SCALE_ROWS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 10000 {
			b.Fatalf("OUTBOX_SCALE_ROWS=%q: want a number of at least 10000", v)
		}
		rows = n
	}
	scaleOnce.Do(func() {
		pool, cfg := pgtest.Schema(b)
		ctx := context.Background()
		t := pgx.Identifier{cfg.Schema, "events_outbox"}.Sanitize()
		lastHour := min(360_000, rows/3)
		start := time.Now()
		for _, q := range []string{
			// A week of dispatched events, 10,000 aggregates.
			fmt.Sprintf(`INSERT INTO %s (event_id, aggregate_id, type, payload, created_at, dispatched_at)
SELECT gen_random_uuid(), ('00000000-0000-4000-8000-' || lpad(to_hex(i %% 10000), 12, '0'))::uuid,
       (ARRAY['order.placed','order.paid','invoice.sent','customer.updated'])[1 + i %% 4],
       '{"order_id":"x","total_cents":4200,"items":[1,2,3]}', d - interval '50 ms', d
FROM generate_series(1, %d) i, LATERAL (SELECT now() - interval '1 hour' - make_interval(secs => (i::float8 / %d) * 6 * 86400) AS d) t`,
				t, rows-lastHour-2500, rows-lastHour-2500),
			// The last hour at 100 per second.
			fmt.Sprintf(`INSERT INTO %s (event_id, aggregate_id, type, payload, created_at, dispatched_at)
SELECT gen_random_uuid(), ('00000000-0000-4000-8000-' || lpad(to_hex(i %% 10000), 12, '0'))::uuid,
       'order.placed', '{"order_id":"x"}', d - interval '50 ms', d
FROM generate_series(1, %d) i, LATERAL (SELECT now() - make_interval(secs => 3600 - i::float8 * 3600 / %d) AS d) t`,
				t, lastHour, lastHour),
			// The backlog: 2,000 pending, 300 held (two errors), 150
			// backing off, 50 parked.
			fmt.Sprintf(`INSERT INTO %s (event_id, aggregate_id, type, payload, created_at, attempts, retry_at, last_error, failed_at, parked_at, parked_reason)
SELECT gen_random_uuid(), ('00000000-0000-4000-8000-' || lpad(to_hex(i %% 10000), 12, '0'))::uuid,
       (ARRAY['order.placed','invoice.sent'])[1 + i %% 2], '{"order_id":"x"}', now() - make_interval(secs => 2500 - i),
       CASE WHEN i <= 450 THEN 3 ELSE 0 END,
       CASE WHEN i <= 300 THEN 'infinity'::timestamptz WHEN i <= 450 THEN now() + interval '1 minute' END,
       CASE WHEN i <= 150 THEN 'permanent: no route for type "invoice.sent" (event ' || i || ')'
            WHEN i <= 300 THEN 'permanent: message of ' || (1000000 + i) || ' bytes is over the limit'
            WHEN i <= 450 THEN 'dial tcp 10.0.0.' || (i %% 9) || ':9092: i/o timeout' END,
       CASE WHEN i <= 450 THEN now() - make_interval(secs => i) END,
       CASE WHEN i > 2450 THEN now() END, CASE WHEN i > 2450 THEN 'set aside' END
FROM generate_series(1, 2500) i`, t),
			"ANALYZE " + t,
		} {
			if _, err := pool.Exec(ctx, q); err != nil {
				scaleErr = err
				return
			}
		}
		var n int64
		_ = pool.QueryRow(ctx, "SELECT count(*) FROM "+t).Scan(&n)
		if err := pool.QueryRow(ctx, "SELECT min(seq) FROM "+t+" WHERE retry_at = 'infinity'").Scan(&scaleRef.held); err != nil {
			scaleErr = err
			return
		}
		// Where the hundredth page of the dispatched listing starts.
		if err := pool.QueryRow(ctx, "SELECT seq FROM "+t+" WHERE dispatched_at IS NOT NULL ORDER BY seq DESC OFFSET 5000 LIMIT 1").Scan(&scaleRef.dispatched); err != nil {
			scaleErr = err
			return
		}
		b.Logf("table of %d events built in %s", n, time.Since(start).Round(time.Second))
		ad, err := admin.New(pool, cfg, nil)
		if err != nil {
			scaleErr = err
			return
		}
		c, err := console.New(console.Options{Admin: ad, Username: testUser, Password: testPass})
		if err != nil {
			scaleErr = err
			return
		}
		scaleSrv = httptest.NewServer(c)
	})
	if scaleErr != nil {
		b.Fatal(scaleErr)
	}
	return scaleSrv, scaleRef
}
