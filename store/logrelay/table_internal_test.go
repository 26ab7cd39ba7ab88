package logrelay

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// TestLogTable holds the contract of the log relay's statements: marks
// that can be repeated and tell a missing row from a dispatched one,
// hand-offs that give a row a fresh seq once, and log-only events that the
// table refuses or cannot read kept, held, instead of lost.
func TestLogTable(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	ctx := context.Background()
	lt, err := newLogTable(cfg)
	if err != nil {
		t.Fatal(err)
	}
	table := pgx.Identifier{cfg.Schema, "events_outbox"}.Sanitize()
	insert := func(agg string) (seq int64) {
		t.Helper()
		if err := pool.QueryRow(ctx, `INSERT INTO `+table+` (aggregate_id, type, payload) VALUES ($1, 'order.placed', '{}')
RETURNING seq`, agg).Scan(&seq); err != nil {
			t.Fatal(err)
		}
		return seq
	}
	a, b := insert("agg-a"), insert("agg-a")

	t.Run("markDispatched", func(t *testing.T) {
		missing, err := lt.markDispatched(ctx, pool, []int64{a, 999999})
		if err != nil {
			t.Fatal(err)
		}
		if len(missing) != 1 || missing[0] != 999999 {
			t.Fatalf("missing = %v, want [999999]: a row that does not exist is missing, a marked one is not", missing)
		}
		// Again: a is dispatched already, which is not missing.
		if missing, err = lt.markDispatched(ctx, pool, []int64{a}); err != nil || len(missing) != 0 {
			t.Fatalf("mark again = %v, %v; want nothing missing", missing, err)
		}
	})

	t.Run("replayedRowIsTheReplays", func(t *testing.T) {
		// c went out and an operator replayed it; a session reading its
		// insert again must neither mark it (the replay is the table
		// path's to publish) nor take it for a row never sent.
		c := insert("agg-c")
		if _, err := lt.markDispatched(ctx, pool, []int64{c}); err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(ctx, `UPDATE `+table+` SET dispatched_at = NULL, replays = replays + 1 WHERE seq = $1`, c); err != nil {
			t.Fatal(err)
		}
		done, err := lt.dispatched(ctx, pool, []int64{c})
		if err != nil || len(done) != 1 {
			t.Fatalf("dispatched = %v, %v; want the replayed row counted sent", done, err)
		}
		if missing, err := lt.markDispatched(ctx, pool, []int64{c}); err != nil || len(missing) != 0 {
			t.Fatalf("mark the replayed row = %v, %v; want nothing missing", missing, err)
		}
		var pending bool
		if err := pool.QueryRow(ctx, `SELECT dispatched_at IS NULL FROM `+table+` WHERE seq = $1`, c).Scan(&pending); err != nil {
			t.Fatal(err)
		}
		if !pending {
			t.Fatal("the stream marked a replayed row dispatched: the replay is lost")
		}
	})

	t.Run("handRow", func(t *testing.T) {
		var bID string
		if err := pool.QueryRow(ctx, `SELECT event_id::text FROM `+table+` WHERE seq = $1`, b).Scan(&bID); err != nil {
			t.Fatal(err)
		}
		seq, found, err := lt.handRow(ctx, pool, b, bID, nil, 0)
		if err != nil || !found || seq <= b {
			t.Fatalf("hand row %d = %d, %v, %v; want a fresh seq above it", b, seq, found, err)
		}
		aggs, err := lt.handedOffAggregates(ctx, pool)
		if err != nil || len(aggs) != 1 || aggs[0] != "agg-a" {
			t.Fatalf("handed-off aggregates = %v, %v; want [agg-a]", aggs, err)
		}
		// The old seq is gone; the row is found handed off: a replay.
		again, found, err := lt.handRow(ctx, pool, b, bID, nil, 0)
		if err != nil || again != 0 || !found {
			t.Fatalf("hand row again = %d, %v, %v; want 0, found", again, found, err)
		}
		// Handed again under its new seq, failed: held, same seq.
		held, _, err := lt.handRow(ctx, pool, seq, bID, &core.Failure{Seq: seq, Reason: "broker refused"}, 0)
		if err != nil || held != seq {
			t.Fatalf("hold row = %d, %v; want %d", held, err, seq)
		}
		var heldForGood bool
		var lastError string
		if err := pool.QueryRow(ctx, `SELECT retry_at = 'infinity', last_error FROM `+table+` WHERE seq = $1`, seq).Scan(&heldForGood, &lastError); err != nil {
			t.Fatal(err)
		}
		if !heldForGood || lastError != "broker refused" {
			t.Fatalf("held = %v, last_error = %q; want held with the reason", heldForGood, lastError)
		}
		if pending, err := lt.aggregateHandedOff(ctx, pool, "agg-a"); err != nil || !pending {
			t.Fatalf("agg-a handed off = %v, %v; want true (held rows hold the aggregate)", pending, err)
		}
		// A row whose transaction this session cannot see is not found.
		if _, found, err := lt.handRow(ctx, pool, 999999, uuid.NewString(), nil, 0); err != nil || found {
			t.Fatalf("hand a missing row = %v, %v; want not found", found, err)
		}
	})

	t.Run("insertEvent", func(t *testing.T) {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(ctx) }()
		ev := logEvent{ID: uuid.NewString(), AggregateID: "agg-m", Type: "order.placed", ContentType: "application/json",
			Payload: []byte(`{"n":1}`), CreatedAt: time.Now()}
		if err := lt.insertEvent(ctx, tx, ev, nil, 0); err != nil {
			t.Fatal(err)
		}
		if err := lt.insertEvent(ctx, tx, ev, nil, 0); err != nil { // read again after a crash
			t.Fatalf("insert the same event again: %v", err)
		}
		bad := ev
		bad.ID, bad.Payload = uuid.NewString(), []byte(`{not json`)
		err = lt.insertEvent(ctx, tx, bad, nil, 0)
		var refused *refusedError
		if !errors.As(err, &refused) {
			t.Fatalf("insert an event the table refuses = %v, want a *refusedError", err)
		}
		// The transaction is still usable: the refused event is kept as
		// unreadable, even under an id that is not a UUID.
		if err := lt.insertUnreadable(ctx, tx, unreadable{Raw: []byte(`{not json`), ID: "not-a-uuid", AggregateID: "agg-m",
			CreatedAt: time.Now(), Reason: refused.Error()}); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		var n int
		var reason string
		if err := pool.QueryRow(ctx, `SELECT count(*) OVER (), last_error FROM `+table+`
WHERE aggregate_id = 'agg-m' AND type = 'outbox.unreadable' AND retry_at = 'infinity'`).Scan(&n, &reason); err != nil {
			t.Fatal(err)
		}
		if n != 1 || !strings.Contains(reason, "the table refuses the event") || !strings.Contains(reason, "not-a-uuid") {
			t.Fatalf("unreadable rows = %d, reason %q", n, reason)
		}
	})
}
