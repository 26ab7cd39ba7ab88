package outbox_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	_ "github.com/lib/pq"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/pgtest"
	tablesrc "github.com/outboxhq/outbox/store/table"
)

// WriteSQL writes inside a database/sql transaction, whatever the driver,
// with the same columns as Write: keys, bytes and content types, topics,
// deliver-at times, headers, and text that needs escaping in an array.
// Every column goes through each driver, and through pgx natively, as one
// statement for many messages and as the one-row statement for one.
func TestWriteSQLWithEachDriver(t *testing.T) {
	for _, tc := range []struct {
		driver string
		one    bool
	}{{"pgx", false}, {"pgx", true}, {"postgres", false}, {"postgres", true}, {"native", false}, {"native", true}} {
		t.Run(fmt.Sprintf("%s/one_at_a_time=%v", tc.driver, tc.one), func(t *testing.T) {
			ctx := context.Background()
			pool, cfg, _ := setup(t)
			var db *sql.DB
			switch tc.driver {
			case "pgx", "native":
				db = stdlib.OpenDBFromPool(pool)
			default:
				var err error
				if db, err = sql.Open("postgres", pgtest.URL(t)); err != nil {
					t.Fatal(err)
				}
			}
			t.Cleanup(func() { _ = db.Close() })
			w := newWriter(t, outbox.WriterOptions{Store: cfg})
			raw := []byte{0, 1, '"', '\\', '{', ',', 0xff}
			at := time.Now().Add(-time.Second).Truncate(time.Microsecond)
			msgs := []outbox.Message{
				{AggregateID: `ord "quoted", {braced} \back`, Type: "order.placed", Payload: map[string]string{"s": `a"b\c,{}`},
					Headers: map[string]string{"tenant": `ac"me`}},
				{AggregateID: "ord_1", Type: "order.paid", ContentType: "application/x-protobuf", Payload: raw, Topic: "payments"},
				{AggregateID: "ord_1", Type: "order.due", Payload: []byte(`null`), DeliverAt: at},
				{AggregateID: "NULL", Type: "order.null", ContentType: "text/plain", Payload: "NULL"},
			}
			batches := [][]outbox.Message{msgs}
			if tc.one {
				batches = nil
				for _, m := range msgs {
					batches = append(batches, []outbox.Message{m})
				}
			}
			for _, batch := range batches {
				if tc.driver == "native" {
					err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return w.Write(ctx, tx, batch...) })
					if err != nil {
						t.Fatalf("write: %v", err)
					}
					continue
				}
				tx, err := db.BeginTx(ctx, nil)
				if err != nil {
					t.Fatal(err)
				}
				if err := w.WriteSQL(ctx, tx, batch...); err != nil {
					_ = tx.Rollback()
					t.Fatalf("write: %v", err)
				}
				if err := tx.Commit(); err != nil {
					t.Fatal(err)
				}
			}
			st, err := tablesrc.New(pool, cfg, nil)
			if err != nil {
				t.Fatal(err)
			}
			c, err := st.Claim(ctx, core.ClaimOptions{Limit: 10})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Release(ctx)
			got := c.Events()
			if len(got) != 4 {
				t.Fatalf("claimed %d events, want 4", len(got))
			}
			if e := got[0]; e.AggregateID != msgs[0].AggregateID || string(e.Payload) != `{"s":"a\"b\\c,{}"}` || e.Headers["tenant"] != `ac"me` {
				t.Errorf("event 0 = %+v", e)
			}
			if e := got[1]; !bytes.Equal(e.Payload, raw) || e.ContentType != "application/x-protobuf" || e.Topic != "payments" {
				t.Errorf("event 1 = %+v", e)
			}
			if e := got[2]; string(e.Payload) != "null" || e.ContentType != "" || e.Topic != "" {
				t.Errorf("event 2 = %+v", e)
			}
			if e := got[3]; e.AggregateID != "NULL" || string(e.Payload) != "NULL" {
				t.Errorf("event 3 = %+v: the text NULL must not become a NULL", e)
			}
			var deliverAt time.Time
			if err := pool.QueryRow(ctx, "SELECT deliver_at FROM "+table(cfg)+" WHERE type = 'order.due'").Scan(&deliverAt); err != nil || !deliverAt.Equal(at) {
				t.Errorf("deliver_at = %v (%v), want %v", deliverAt, err, at)
			}
		})
	}
}

// WriteSQL validates as Write does: nothing reaches the database.
func TestWriteSQLValidates(t *testing.T) {
	w := newWriter(t, outbox.WriterOptions{})
	err := w.WriteSQL(context.Background(), failingSQL{}, outbox.Message{AggregateID: "", Type: "t", Payload: []byte(`{}`)})
	var verr *outbox.ValidationError
	if !errors.As(err, &verr) || verr.Field != "aggregate_id" {
		t.Fatalf("err = %v, want a ValidationError naming aggregate_id", err)
	}
}

type failingSQL struct{}

func (failingSQL) ExecContext(context.Context, string, ...any) (sql.Result, error) {
	return nil, errors.New("reached the database")
}
