package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
	tablesrc "github.com/outboxhq/outbox/store/table"
)

const orderID = "0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0d"

func newWriter(t *testing.T, o outbox.WriterOptions) *outbox.Writer {
	t.Helper()
	w, err := outbox.NewWriter(o)
	if err != nil {
		t.Fatalf("new writer: %v", err)
	}
	return w
}

func table(cfg store.Config) string {
	cfg, _ = cfg.WithDefaults()
	return pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize()
}

// setup returns a migrated schema with a business table "orders" in it.
func setup(t *testing.T) (*pgxpool.Pool, store.Config, string) {
	t.Helper()
	pool, cfg := pgtest.Schema(t)
	orders := pgx.Identifier{cfg.Schema, "orders"}.Sanitize()
	if _, err := pool.Exec(context.Background(), "CREATE TABLE "+orders+" (id uuid PRIMARY KEY)"); err != nil {
		t.Fatal(err)
	}
	return pool, cfg, orders
}

func count(t *testing.T, pool *pgxpool.Pool, tbl string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM "+tbl).Scan(&n); err != nil {
		t.Fatalf("count %s: %v", tbl, err)
	}
	return n
}

func placeOrder(ctx context.Context, w *outbox.Writer, tx pgx.Tx, orders string, msgs ...outbox.Message) error {
	if _, err := tx.Exec(ctx, "INSERT INTO "+orders+" (id) VALUES ($1)", orderID); err != nil {
		return err
	}
	return w.Write(ctx, tx, msgs...)
}

var placed = outbox.Message{AggregateID: orderID, Type: "order.placed", Payload: map[string]any{"total": 42}}

func TestEventCommitsWithBusinessRow(t *testing.T) {
	ctx := context.Background()
	pool, cfg, orders := setup(t)
	w := newWriter(t, outbox.WriterOptions{Store: cfg})
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return placeOrder(ctx, w, tx, orders, placed) })
	if err != nil {
		t.Fatal(err)
	}
	if count(t, pool, orders) != 1 || count(t, pool, table(cfg)) != 1 {
		t.Fatal("the business row and its event did not commit together")
	}
	var typ, agg, payload string
	err = pool.QueryRow(ctx, "SELECT type, aggregate_id::text, payload::text FROM "+table(cfg)).Scan(&typ, &agg, &payload)
	if err != nil {
		t.Fatal(err)
	}
	if typ != "order.placed" || agg != orderID || payload != `{"total":42}` {
		t.Fatalf("stored %s %s %s", typ, agg, payload)
	}
}

func TestRolledBackBusinessWriteLeavesNoEvent(t *testing.T) {
	ctx := context.Background()
	pool, cfg, orders := setup(t)
	w := newWriter(t, outbox.WriterOptions{Store: cfg})
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := placeOrder(ctx, w, tx, orders, placed); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if count(t, pool, orders) != 0 || count(t, pool, table(cfg)) != 0 {
		t.Fatal("a rolled-back transaction left rows behind")
	}
}

// When the event cannot be written, the error reaches the caller, whose
// rollback takes the business row with it.
func TestFailedEventWriteRollsBackBusinessWrite(t *testing.T) {
	ctx := context.Background()
	pool, cfg, orders := setup(t)
	missing := cfg
	missing.Table = "no_such_table"
	for _, tc := range []struct {
		name string
		w    *outbox.Writer
		msg  outbox.Message
	}{
		{"validation", newWriter(t, outbox.WriterOptions{Store: cfg}), outbox.Message{AggregateID: orderID, Type: "order.placed", Payload: []byte("{not json")}},
		{"insert", newWriter(t, outbox.WriterOptions{Store: missing}), placed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return placeOrder(ctx, tc.w, tx, orders, tc.msg) })
			if err == nil {
				t.Fatal("write succeeded")
			}
			var verr *outbox.ValidationError
			if tc.name == "validation" && !errors.As(err, &verr) {
				t.Fatalf("error %v is not a *ValidationError", err)
			}
			var pgErr *pgconn.PgError
			if tc.name == "insert" && (!errors.As(err, &pgErr) || pgErr.Code != "42P01") {
				t.Fatalf("error %v does not wrap the database's undefined-table error", err)
			}
			if count(t, pool, orders) != 0 || count(t, pool, table(cfg)) != 0 {
				t.Fatal("the business row committed without its event")
			}
		})
	}
}

// execCounter is an outbox.DBTX counting statements on the way to tx.
type execCounter struct {
	tx    outbox.DBTX
	calls int
	args  []any
}

func (c *execCounter) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	c.calls++
	c.args = args
	if c.tx == nil {
		return pgconn.CommandTag{}, nil
	}
	return c.tx.Exec(ctx, sql, args...)
}

func TestManyEventsInOneStatement(t *testing.T) {
	ctx := context.Background()
	pool, cfg := pgtest.Schema(t)
	w := newWriter(t, outbox.WriterOptions{Store: cfg})
	const n = 1000
	msgs := make([]outbox.Message, n)
	for i := range msgs {
		msgs[i] = outbox.Message{AggregateID: orderID, Type: "order.line_added", Payload: map[string]int{"line": i}}
	}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		ec := &execCounter{tx: tx}
		if err := w.Write(ctx, ec, msgs...); err != nil {
			return err
		}
		if ec.calls != 1 {
			return fmt.Errorf("%d statements for one Write, want 1", ec.calls)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	rows, err := pool.Query(ctx, "SELECT (payload->>'line')::int FROM "+table(cfg)+" ORDER BY seq")
	if err != nil {
		t.Fatal(err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		t.Fatal(err)
	}
	if len(lines) != n {
		t.Fatalf("stored %d events, want %d", len(lines), n)
	}
	for i, l := range lines {
		if l != i {
			t.Fatalf("event %d in id order carries line %d: ids must follow the order of the Write", i, l)
		}
	}
}

func TestValidationErrors(t *testing.T) {
	w := newWriter(t, outbox.WriterOptions{MaxPayloadBytes: 64})
	lw, err := outbox.NewLogWriter(outbox.WriterOptions{MaxPayloadBytes: 64})
	if err != nil {
		t.Fatal(err)
	}
	writers := []struct {
		name  string
		write func(tx outbox.DBTX, msgs ...outbox.Message) error
	}{
		{"Writer", func(tx outbox.DBTX, msgs ...outbox.Message) error { return w.Write(context.Background(), tx, msgs...) }},
		{"LogWriter", func(tx outbox.DBTX, msgs ...outbox.Message) error { return lw.Write(context.Background(), tx, msgs...) }},
	}
	ok := outbox.Message{AggregateID: orderID, Type: "order.placed", Payload: []byte(`{}`)}
	with := func(f func(m *outbox.Message)) outbox.Message { m := ok; f(&m); return m }
	for _, tc := range []struct {
		name  string
		msg   outbox.Message
		field string
	}{
		{"empty aggregate", with(func(m *outbox.Message) { m.AggregateID = "" }), "aggregate_id"},
		{"aggregate over 255 bytes", with(func(m *outbox.Message) { m.AggregateID = strings.Repeat("k", 256) }), "aggregate_id"},
		{"control character in aggregate", with(func(m *outbox.Message) { m.AggregateID = "ord\x01" }), "aggregate_id"},
		{"aggregate not utf-8", with(func(m *outbox.Message) { m.AggregateID = "ord\xff" }), "aggregate_id"},
		{"content type not a media type", with(func(m *outbox.Message) { m.ContentType = "protobuf" }), "content_type"},
		{"content type with a newline", with(func(m *outbox.Message) { m.ContentType = "text/plain\n" }), "content_type"},
		{"bytes payload of a struct", with(func(m *outbox.Message) { m.ContentType = "application/x-protobuf"; m.Payload = struct{}{} }), "payload"},
		{"bytes payload nil", with(func(m *outbox.Message) { m.ContentType = "application/octet-stream"; m.Payload = nil }), "payload"},
		{"bytes payload over the limit", with(func(m *outbox.Message) { m.ContentType = "avro/binary"; m.Payload = make([]byte, 65) }), "payload"},
		{"json content type checks json", with(func(m *outbox.Message) { m.ContentType = "application/problem+json"; m.Payload = []byte("nope") }), "payload"},
		{"topic with a space", with(func(m *outbox.Message) { m.Topic = "my topic" }), "topic"},
		{"topic over 255 bytes", with(func(m *outbox.Message) { m.Topic = strings.Repeat("t", 256) }), "topic"},
		{"deliver_at out of range", with(func(m *outbox.Message) { m.DeliverAt = time.Date(300000, 1, 1, 0, 0, 0, 0, time.UTC) }), "deliver_at"},
		{"reserved header content-type", with(func(m *outbox.Message) { m.Headers = map[string]string{event.HeaderContentType: "x"} }), "headers"},
		{"reserved header event_seq", with(func(m *outbox.Message) { m.Headers = map[string]string{event.HeaderEventSeq: "1"} }), "headers"},
		{"empty type", with(func(m *outbox.Message) { m.Type = "" }), "type"},
		{"blank type", with(func(m *outbox.Message) { m.Type = " \t" }), "type"},
		{"control character in type", with(func(m *outbox.Message) { m.Type = "order\nplaced" }), "type"},
		{"long type", with(func(m *outbox.Message) { m.Type = strings.Repeat("t", 256) }), "type"},
		{"nil payload", with(func(m *outbox.Message) { m.Payload = nil }), "payload"},
		{"payload not json", with(func(m *outbox.Message) { m.Payload = []byte(`{"a":}`) }), "payload"},
		{"raw message not json", with(func(m *outbox.Message) { m.Payload = json.RawMessage(`nope`) }), "payload"},
		{"empty payload", with(func(m *outbox.Message) { m.Payload = []byte{} }), "payload"},
		{"payload not serializable", with(func(m *outbox.Message) { m.Payload = func() {} }), "payload"},
		{"payload not utf-8", with(func(m *outbox.Message) { m.Payload = []byte("\"\xff\"") }), "payload"},
		{"payload over the limit", with(func(m *outbox.Message) { m.Payload = map[string]string{"a": strings.Repeat("x", 64)} }), "payload"},
		{"reserved header event_uid", with(func(m *outbox.Message) { m.Headers = map[string]string{event.HeaderEventUID: "x"} }), "headers"},
		{"reserved header event_id", with(func(m *outbox.Message) { m.Headers = map[string]string{event.HeaderEventID: "x"} }), "headers"},
		{"reserved header type", with(func(m *outbox.Message) { m.Headers = map[string]string{event.HeaderType: "x"} }), "headers"},
		{"reserved header aggregate_id", with(func(m *outbox.Message) { m.Headers = map[string]string{event.HeaderAggregateID: "x"} }), "headers"},
		{"empty header name", with(func(m *outbox.Message) { m.Headers = map[string]string{"": "x"} }), "headers"},
		{"NUL in header", with(func(m *outbox.Message) { m.Headers = map[string]string{"k": "a\x00b"} }), "headers"},
		{"id not a uuid", with(func(m *outbox.Message) { m.ID = "abc" }), "id"},
	} {
		// The log-only writer refuses exactly what the row writer does.
		for _, wr := range writers {
			t.Run(wr.name+"/"+tc.name, func(t *testing.T) {
				ec := &execCounter{}
				err := wr.write(ec, ok, tc.msg)
				var verr *outbox.ValidationError
				if !errors.As(err, &verr) {
					t.Fatalf("error %v, want a *ValidationError", err)
				}
				if verr.Field != tc.field || verr.Index != 1 {
					t.Fatalf("error names message %d field %q, want message 1 field %q (%v)", verr.Index, verr.Field, tc.field, err)
				}
				if !strings.Contains(err.Error(), tc.field) {
					t.Fatalf("message %q does not name %s", err, tc.field)
				}
				if ec.calls != 0 {
					t.Fatal("an invalid Write reached the database")
				}
			})
		}
	}
	// What only the log message format cannot carry: a deliver-at time
	// beyond RFC 3339's four-digit years, which a row holds.
	far := with(func(m *outbox.Message) { m.DeliverAt = time.Date(12000, 1, 1, 0, 0, 0, 0, time.UTC) })
	if err := w.Write(context.Background(), &execCounter{}, far); err != nil {
		t.Fatalf("row writer refused a deliver_at in year 12000: %v", err)
	}
	var verr *outbox.ValidationError
	if err := lw.Write(context.Background(), &execCounter{}, far); !errors.As(err, &verr) || verr.Field != "deliver_at" {
		t.Fatalf("log writer: %v, want a ValidationError naming deliver_at", err)
	}
	if _, err := outbox.NewWriter(outbox.WriterOptions{MaxPayloadBytes: -1}); err == nil || !strings.Contains(err.Error(), "MaxPayloadBytes") {
		t.Fatalf("negative MaxPayloadBytes: %v", err)
	}
	if _, err := outbox.NewWriter(outbox.WriterOptions{Store: store.Config{Table: strings.Repeat("t", 100)}}); err == nil {
		t.Fatal("an overlong table name was accepted")
	}
	if err := w.Write(context.Background(), &execCounter{}); err != nil {
		t.Fatalf("empty Write: %v", err)
	}
}

func TestPayloadStoredByteExact(t *testing.T) {
	ctx := context.Background()
	pool, cfg := pgtest.Schema(t)
	w := newWriter(t, outbox.WriterOptions{Store: cfg})
	type order struct {
		Z     int    `json:"z"`
		A     string `json:"a"`
		Note  string `json:"note"`
		Empty []int  `json:"empty"`
	}
	cases := []struct {
		payload any
		want    string
	}{
		{[]byte("{ \"z\" : 1,\n\t\"a\" : [1.50, 2e3, -0] , \"z\":2}"), "{ \"z\" : 1,\n\t\"a\" : [1.50, 2e3, -0] , \"z\":2}"},
		{json.RawMessage(`"\u00e9\ud83d\ude00\u0000"`), `"\u00e9\ud83d\ude00\u0000"`},
		{order{Z: 1, A: "é <&>", Note: "\u2028"}, `{"z":1,"a":"é \u003c\u0026\u003e","note":"\u2028","empty":null}`},
		{"text", `"text"`},
		{12345678901234567890.0, `12345678901234567000`},
	}
	var msgs []outbox.Message
	for _, c := range cases {
		msgs = append(msgs, outbox.Message{AggregateID: orderID, Type: "t.x", Payload: c.payload})
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return w.Write(ctx, tx, msgs...) }); err != nil {
		t.Fatal(err)
	}
	s, err := tablesrc.New(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	c, err := s.Claim(ctx, core.ClaimOptions{Limit: 10})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release(ctx)
	if len(c.Events()) != len(cases) {
		t.Fatalf("claimed %d events, want %d", len(c.Events()), len(cases))
	}
	for i, e := range c.Events() {
		if string(e.Payload) != cases[i].want {
			t.Errorf("payload %d came back as %q, want %q", i, e.Payload, cases[i].want)
		}
	}
}

func TestHeadersEventIDAndTraceContext(t *testing.T) {
	ctx := context.Background()
	pool, cfg := pgtest.Schema(t)
	w := newWriter(t, outbox.WriterOptions{Store: cfg, Propagator: propagation.TraceContext{}})
	sc := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{1, 2, 3}, SpanID: trace.SpanID{4, 5, 6}, TraceFlags: trace.FlagsSampled,
	})
	tctx := trace.ContextWithSpanContext(ctx, sc)
	uid := "0190A7F4-0000-7000-8000-000000000001" // upper case; stored canonical
	msg := outbox.Message{AggregateID: orderID, Type: "t.x", Payload: []byte(`1`), ID: uid, Headers: map[string]string{"tenant": "acme"}}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return w.Write(tctx, tx, msg) }); err != nil {
		t.Fatal(err)
	}
	var gotUID string
	var headers map[string]string
	if err := pool.QueryRow(ctx, "SELECT event_id::text, headers FROM "+table(cfg)).Scan(&gotUID, &headers); err != nil {
		t.Fatal(err)
	}
	if gotUID != strings.ToLower(uid) {
		t.Fatalf("uid stored as %s", gotUID)
	}
	want := "00-01020300000000000000000000000000-0405060000000000-01"
	if headers["tenant"] != "acme" || headers["traceparent"] != want || len(headers) != 2 {
		t.Fatalf("headers = %v, want tenant and traceparent %s", headers, want)
	}
}

func TestWriteNotifiesAtCommit(t *testing.T) {
	ctx := context.Background()
	pool, cfg := pgtest.SchemaWith(t, store.Config{NotifyChannel: `notify "` + randomName() + `" \'x'`})
	w := newWriter(t, outbox.WriterOptions{Store: cfg})
	conn, err := pgx.Connect(ctx, pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{cfg.NotifyChannel}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	// Producers wake a relay that sleeps, as an idle one does.
	st, err := tablesrc.New(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	lctx, stopListen := context.WithCancel(ctx)
	listening := make(chan struct{})
	go func() {
		defer close(listening)
		_ = st.Listen(lctx, func() {})
	}()
	defer func() { stopListen(); <-listening }()
	if _, err := st.Sleep(ctx); err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Write(ctx, tx, placed, placed); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 5e9)
	defer cancel()
	n, err := conn.WaitForNotification(wctx)
	if err != nil {
		t.Fatalf("no notification after commit: %v", err)
	}
	if n.Channel != cfg.NotifyChannel {
		t.Fatalf("notified on %q, want %q", n.Channel, cfg.NotifyChannel)
	}
}

func randomName() string { return strconv.FormatInt(time.Now().UnixNano(), 36) }
