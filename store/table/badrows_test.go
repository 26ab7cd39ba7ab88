package table_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/admin"
	"github.com/outboxhq/outbox/store/table"
)

// rawRow is an outbox row as a producer writing plain SQL may leave it.
type rawRow struct {
	agg, typ, payload string
	headers           *string // nil is SQL NULL
}

// insertRaw writes a row by SQL, bypassing the Go writer's checks, and
// returns its id.
func insertRaw(ctx context.Context, t testing.TB, pool *pgxpool.Pool, table string, r rawRow) (int64, error) {
	t.Helper()
	var id int64
	err := pool.QueryRow(ctx, `INSERT INTO `+table+` (event_id, aggregate_id, type, payload, headers)
VALUES ($1, $2, $3, $4::json, $5::jsonb) RETURNING seq`, uuid.NewString(), r.agg, r.typ, r.payload, r.headers).Scan(&id)
	return id, err
}

// sink is a publisher that keeps every event it is given.
type sink struct {
	mu  sync.Mutex
	got map[int64]core.Event
}

func (s *sink) Publish(_ context.Context, e *core.Event) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.got == nil {
		s.got = map[int64]core.Event{}
	}
	s.got[e.Seq] = *e
	return nil
}

func (s *sink) Close() error { return nil }

func (s *sink) has(id int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.got[id]
	return ok
}

// rejectCounter is a core.Observer counting rejected rows. With held
// set, it also notes the rows reported before their hold was recorded.
type rejectCounter struct {
	claimCounter
	held     func(seq int64) bool
	mu       sync.Mutex
	rejected []int64
	early    []int64
}

func (c *rejectCounter) Rejected(e *core.Event, _ error) {
	early := c.held != nil && !c.held(e.Seq)
	c.mu.Lock()
	defer c.mu.Unlock()
	c.rejected = append(c.rejected, e.Seq)
	if early {
		c.early = append(c.early, e.Seq)
	}
}

func (c *rejectCounter) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.rejected)
}

func ptr(s string) *string { return &s }

// A row the relay cannot turn into an event is held with a reason naming
// the problem; later events of its aggregate wait behind it and every
// other aggregate flows.
func TestUnrelayableRowsAreHeld(t *testing.T) {
	cases := []struct {
		name   string
		row    rawRow
		reason string
	}{
		{"headers number value", rawRow{typ: "a.b", payload: `{}`, headers: ptr(`{"n":1}`)}, "headers are not a JSON object of strings"},
		{"headers array", rawRow{typ: "a.b", payload: `{}`, headers: ptr(`[1,2]`)}, "headers are not a JSON object of strings"},
		{"headers string", rawRow{typ: "a.b", payload: `{}`, headers: ptr(`"abc"`)}, "headers are not a JSON object of strings"},
		{"headers nested", rawRow{typ: "a.b", payload: `{}`, headers: ptr(`{"a":{"b":"c"}}`)}, "headers are not a JSON object of strings"},
		{"type empty", rawRow{typ: "", payload: `{}`}, "type is empty"},
		{"type space", rawRow{typ: "order placed", payload: `{}`}, "whitespace or a control character"},
		{"type newline", rawRow{typ: "order\nplaced", payload: `{}`}, "whitespace or a control character"},
		{"type control", rawRow{typ: "order\x01placed", payload: `{}`}, "whitespace or a control character"},
		{"payload over limit", rawRow{typ: "a.b", payload: `"` + strings.Repeat("x", 5000) + `"`}, "over the relay's limit of 4096"},
	}
	for _, tc := range cases {
		for _, unordered := range []bool{false, true} {
			name := tc.name
			if unordered {
				name += " unordered"
			}
			t.Run(name, func(t *testing.T) {
				ctx := context.Background()
				pool, cfg := pgtest.Schema(t)
				dropRowChecks(ctx, t, pool, cfg)
				cfg.MaxEventBytes = 4096
				s, err := table.New(pool, cfg, nil)
				if err != nil {
					t.Fatal(err)
				}
				ad, err := admin.New(pool, cfg, nil)
				if err != nil {
					t.Fatal(err)
				}
				table := ident(cfg)
				bad, other := uuid.NewString(), uuid.NewString()
				mustInsert := func(r rawRow) int64 {
					t.Helper()
					id, err := insertRaw(ctx, t, pool, table, r)
					if err != nil {
						t.Fatalf("insert %+v: %v", r, err)
					}
					return id
				}
				otherFirst := mustInsert(rawRow{agg: other, typ: "a.b", payload: `{"n":1}`})
				row := tc.row
				row.agg = bad
				badID := mustInsert(row)
				behind := mustInsert(rawRow{agg: bad, typ: "a.b", payload: `{"n":2}`})
				otherLast := mustInsert(rawRow{agg: other, typ: "a.b", payload: `{"n":3}`})

				pub := &sink{}
				// The observer reports a row the relay holds: by then the
				// hold is in the table for an operator to see.
				obs := &rejectCounter{held: func(seq int64) bool {
					var held bool
					err := pool.QueryRow(ctx, `SELECT retry_at = 'infinity' FROM `+table+` WHERE seq = $1`, seq).Scan(&held)
					return err == nil && held
				}}
				r, err := core.New(s, pub, core.Options{PollInterval: 10 * time.Millisecond, Observer: obs, Unordered: unordered})
				if err != nil {
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
				}()
				waitFor(t, "the other aggregate's events", func() bool { return pub.has(otherFirst) && pub.has(otherLast) })
				waitFor(t, "the bad row to be held", func() bool { return obs.count() > 0 })
				if unordered {
					waitFor(t, "the event behind the bad row, unordered", func() bool { return pub.has(behind) })
				} else {
					// Give the relay time to (wrongly) publish it.
					time.Sleep(100 * time.Millisecond)
					if pub.has(behind) {
						t.Fatal("ordered: an event behind a held row was published")
					}
				}
				if pub.has(badID) {
					t.Fatal("the bad row was published")
				}
				if n := obs.count(); n != 1 {
					t.Errorf("observer saw %d rejections, want 1 (a held row is not claimed again)", n)
				}
				obs.mu.Lock()
				early := obs.early
				obs.mu.Unlock()
				if len(early) > 0 {
					t.Errorf("observer was told of rejected rows %v before their hold was recorded", early)
				}
				// The hold is committed with the batch's marks, which can
				// come after the publish of the event behind it.
				var e admin.StuckEvent
				waitFor(t, "stuck to list the bad row", func() bool {
					stuck, err := ad.Stuck(ctx, admin.StuckOptions{})
					if err != nil {
						t.Fatal(err)
					}
					for _, e = range stuck {
						if e.Seq == badID {
							return true
						}
					}
					return false
				})
				if !e.Held || !strings.Contains(e.LastError, tc.reason) || !strings.Contains(e.LastError, "cannot relay row") {
					t.Errorf("stuck lists the bad row as held=%v reason %q; want held, reason containing %q", e.Held, e.LastError, tc.reason)
				}
				if !unordered && e.HeldBack != 1 {
					t.Errorf("stuck says the bad row holds back %d events, want 1", e.HeldBack)
				}
				// An operator fixes the row and retries it: both go out in order.
				if _, err := pool.Exec(ctx, `UPDATE `+table+` SET type = 'a.b', headers = NULL, payload = '{}' WHERE seq = $1`, badID); err != nil {
					t.Fatal(err)
				}
				if _, err := ad.Retry(ctx, admin.Selector{Seqs: []int64{badID}}); err != nil {
					t.Fatal(err)
				}
				waitFor(t, "the fixed row and the one behind it", func() bool { return pub.has(badID) && pub.has(behind) })
			})
		}
	}
}

// A claim is bounded by bytes: a backlog of rows near the event limit is
// claimed a few at a time, never all at once, and always at least one.
func TestClaimBoundedByBytes(t *testing.T) {
	ctx := context.Background()
	pool, cfg := pgtest.Schema(t)
	cfg.MaxEventBytes = 10_000
	cfg.MaxClaimBytes = 25_000
	s, err := table.New(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	table := ident(cfg)
	big := `"` + strings.Repeat("y", 9000) + `"`
	for range 10 {
		if _, err := insertRaw(ctx, t, pool, table, rawRow{agg: uuid.NewString(), typ: "a.b", payload: big}); err != nil {
			t.Fatal(err)
		}
	}
	var total int
	for claims := 0; total < 10; claims++ {
		if claims > 10 {
			t.Fatalf("ten rows took more than ten claims")
		}
		c, err := s.Claim(ctx, core.ClaimOptions{Limit: 500})
		if err != nil {
			t.Fatal(err)
		}
		n := len(c.Events())
		if n == 0 || n > 2 {
			t.Fatalf("claim of 9 kB rows under a 25 kB limit took %d rows, want 1 or 2", n)
		}
		if tr, ok := c.(core.Truncated); total+n < 10 && (!ok || !tr.Truncated()) {
			t.Error("a claim cut short by bytes does not say so")
		}
		ids := make([]int64, n)
		for i, e := range c.Events() {
			if len(e.Payload) != len(big) {
				t.Fatalf("payload of %d bytes, want %d", len(e.Payload), len(big))
			}
			ids[i] = e.Seq
		}
		if err := c.Complete(ctx, ids, nil); err != nil {
			t.Fatal(err)
		}
		total += n
	}
}

func TestByteLimitsValidated(t *testing.T) {
	for _, c := range []store.Config{
		{MaxEventBytes: -1},
		{MaxEventBytes: 2 << 30},
		{MaxEventBytes: 1000, MaxClaimBytes: 999},
		{MaxClaimBytes: 2 << 30},
	} {
		if _, err := c.WithDefaults(); err == nil || !strings.Contains(err.Error(), "_bytes") {
			t.Errorf("%+v: error %v, want one naming the byte limit", c, err)
		}
	}
	c, err := store.Config{MaxEventBytes: 32 << 20}.WithDefaults()
	if err != nil || c.MaxClaimBytes != 32<<20 {
		t.Errorf("a large event limit raises the default claim limit to it: got %d, %v", c.MaxClaimBytes, err)
	}
}

// dropRowChecks removes the table's CHECK constraints, to stand for rows
// written before the constraints existed.
func dropRowChecks(ctx context.Context, t testing.TB, pool *pgxpool.Pool, cfg store.Config) {
	t.Helper()
	rows, err := pool.Query(ctx, `SELECT conname FROM pg_constraint WHERE conrelid = $1::regclass AND contype = 'c'`, ident(cfg))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for rows.Next() {
		var n string
		if err := rows.Scan(&n); err != nil {
			t.Fatal(err)
		}
		names = append(names, n)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for _, n := range names {
		if _, err := pool.Exec(ctx, `ALTER TABLE `+ident(cfg)+` DROP CONSTRAINT `+quote(n)); err != nil {
			t.Fatal(err)
		}
	}
}

func ident(cfg store.Config) string {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		panic(err)
	}
	return pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize()
}

func quote(name string) string { return pgx.Identifier{name}.Sanitize() }
