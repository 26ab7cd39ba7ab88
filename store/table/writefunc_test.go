package table_test

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
)

func writeFunc(cfg store.Config) string {
	return pgx.Identifier{cfg.Schema, cfg.Table + "_write"}.Sanitize()
}

// The write function is the producer's API for any language: one call in
// the caller's transaction writes an event as the Go writer does, returns
// its event_id and wakes a sleeping relay at commit.
func TestWriteFunction(t *testing.T) {
	ctx := context.Background()
	pool, cfg := pgtest.Schema(t)
	in := newInstance(t, pool, cfg)
	fn := writeFunc(in.cfg)

	listener, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer listener.Release()
	if _, err := listener.Exec(ctx, "LISTEN "+pgx.Identifier{in.cfg.NotifyChannel}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	// Producers wake a relay that sleeps, as an idle one does.
	if _, err := in.s.Sleep(ctx); err != nil {
		t.Fatal(err)
	}
	defer in.s.CloseSleeper(ctx)

	given := uuid.NewString()
	raw := []byte{0x08, 0x96, 0x01, 0x00, 0xff}
	at := time.Now().Add(time.Hour).Truncate(time.Microsecond)
	var ids [5]string
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		// As psql would: a literal payload is text, taken as JSON.
		if err := tx.QueryRow(ctx, `SELECT `+fn+`('ord_2Xb9', 'order.placed', '{"total": 42}')`).Scan(&ids[0]); err != nil {
			return err
		}
		if err := tx.QueryRow(ctx, `SELECT `+fn+`('ord_2Xb9', 'order.paid', $1::bytea,
            content_type => 'application/x-protobuf', topic => 'payments', headers => '{"tenant": "acme"}')`, raw).Scan(&ids[1]); err != nil {
			return err
		}
		if err := tx.QueryRow(ctx, `SELECT `+fn+`('42', 'order.reminder', '{"n": 1}'::jsonb, deliver_at => $1, event_id => $2)`, at, given).Scan(&ids[2]); err != nil {
			return err
		}
		if err := tx.QueryRow(ctx, `SELECT `+fn+`('42', 'order.note', 'plain words', content_type => 'text/plain')`).Scan(&ids[3]); err != nil {
			return err
		}
		return tx.QueryRow(ctx, `SELECT `+fn+`('43', 'order.json', '[1,2]'::json)`).Scan(&ids[4])
	})
	if err != nil {
		t.Fatalf("write through the function: %v", err)
	}
	if ids[2] != given {
		t.Errorf("returned event_id %s, want the given %s", ids[2], given)
	}
	for i, id := range ids {
		if u, err := uuid.Parse(id); err != nil || (i != 2 && u.Version() != 7) {
			t.Errorf("event_id %d = %q, want a UUIDv7", i, id)
		}
	}
	waitCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if _, err := listener.Conn().WaitForNotification(waitCtx); err != nil {
		t.Fatalf("no wake-up after the commit: %v", err)
	}

	got := in.claimAll(ctx, t, false)
	if len(got) != 3 {
		t.Fatalf("claimed %v, want order.placed, order.paid and order.json (42 waits for its reminder)", types(got))
	}
	byType := map[string]core.Event{}
	for _, e := range got {
		byType[e.Type] = e
	}
	if e := byType["order.placed"]; string(e.Payload) != `{"total": 42}` || e.ID != ids[0] || e.AggregateID != "ord_2Xb9" {
		t.Errorf("order.placed = %+v", e)
	}
	if e := byType["order.paid"]; !bytes.Equal(e.Payload, raw) || e.ContentType != "application/x-protobuf" || e.Topic != "payments" || e.Headers["tenant"] != "acme" {
		t.Errorf("order.paid = %+v", e)
	}
	if e := byType["order.json"]; string(e.Payload) != `[1,2]` {
		t.Errorf("order.json = %+v", e)
	}
	var deliverAt time.Time
	if err := pool.QueryRow(ctx, "SELECT deliver_at FROM "+in.table()+" WHERE event_id = $1", given).Scan(&deliverAt); err != nil || !deliverAt.Equal(at) {
		t.Errorf("deliver_at = %v (%v), want %v", deliverAt, err, at)
	}
}

func TestWriteFunctionRefusesBadArguments(t *testing.T) {
	ctx := context.Background()
	pool, cfg := pgtest.Schema(t)
	in := newInstance(t, pool, cfg)
	fn := writeFunc(in.cfg)
	for _, tc := range []struct{ name, args, want string }{
		{"empty key", `'', 't', '{}'`, "aggregate_id is empty"},
		{"null key", `NULL, 't', '{}'`, "aggregate_id is empty"},
		{"long key", `repeat('k', 256), 't', '{}'`, "aggregate_id is 256 bytes"},
		{"control in key", `E'k\x07', 't', '{}'`, "aggregate_id contains a control character"},
		{"empty type", `'k', '', '{}'`, "type is empty"},
		{"type with space", `'k', 'a b', '{}'`, "contains whitespace"},
		{"null payload", `'k', 't', NULL::text`, "payload is null"},
		{"payload not json", `'k', 't', '{nope'`, "invalid input syntax for type json"},
		{"bytes not utf-8 for json", `'k', 't', '\xff'::bytea`, "invalid byte sequence"},
		{"bad content type", `'k', 't', 'x', content_type => 'protobuf'`, "content_type 'protobuf' is not a media type"},
		{"headers not an object", `'k', 't', '{}', headers => '[1]'`, "headers are not a JSON object of strings"},
		{"header not a string", `'k', 't', '{}', headers => '{"a": 1}'`, "headers are not a JSON object of strings"},
		{"reserved header", `'k', 't', '{}', headers => '{"event_id": "x"}'`, "header name 'event_id' is set by the relay"},
		{"empty header name", `'k', 't', '{}', headers => '{"": "x"}'`, "headers have an empty name"},
		{"topic with space", `'k', 't', '{}', topic => 'a b'`, "topic 'a b'"},
		{"infinite deliver_at", `'k', 't', '{}', deliver_at => 'infinity'`, "deliver_at is not a finite time"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := pool.Exec(ctx, "SELECT "+fn+"("+tc.args+")")
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want %q", err, tc.want)
			}
		})
	}
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+in.table()).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d rows after refused calls (%v)", n, err)
	}
}
