package logrelay_test

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store/admin"
	"github.com/outboxhq/outbox/store/logrelay"
)

// flavours are the two producer flavours of log mode.
var flavours = []struct {
	name  string
	table bool
}{{"rows", true}, {"messages", false}}

// writeMsgs commits msgs in one transaction, as rows or as log-only
// messages.
func (e *env) writeMsgs(table bool, msgs ...outbox.Message) {
	e.t.Helper()
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		if table {
			return e.rows.Write(ctx, tx, msgs...)
		}
		return e.log.Write(ctx, tx, msgs...)
	})
	if err != nil {
		e.t.Fatalf("write: %v", err)
	}
}

// The producers' table contract through the log: any string key, bytes
// payloads with their content type (empty and non-UTF-8 ones too), JSON
// with a JSON content type, a topic per event, and a deliver-at time
// already past, published by the log relay itself, each exactly as
// written. Rows come from Writer and from the SQL write function;
// messages from LogWriter and from SQL (json_build_object, base64 as
// PostgreSQL's encode writes it, line breaks and all).
func TestRelaysProducerFields(t *testing.T) {
	for _, fl := range flavours {
		t.Run(fl.name, func(t *testing.T) {
			e := newEnv(t)
			e.createSlot()
			pub := &recorder{}
			e.start(pub, e.opts())
			id := func() string { return uuid.Must(uuid.NewV7()).String() }
			proto := []byte{0x0a, 0x03, 0xff, 0x00, 0x80, '"', '\\'}
			want := []outbox.Message{
				{ID: id(), AggregateID: "ord_2Xb9", Type: "invoice.due", ContentType: "application/x-protobuf", Payload: proto, Topic: "billing.reminders"},
				{ID: id(), AggregateID: "ord_2Xb9", Type: "invoice.empty", ContentType: "application/octet-stream", Payload: []byte{}},
				{ID: id(), AggregateID: "12345", Type: "order.placed", ContentType: "application/cloudevents+json", Payload: []byte(`{"a" : [1, 2.50]}`),
					Headers: map[string]string{"tenant": "acme"}},
				{ID: id(), AggregateID: "12345", Type: "order.paid", Payload: []byte(`{"late":true}`), DeliverAt: time.Now().Add(-time.Hour)},
			}
			e.writeMsgs(fl.table, want[:2]...)
			e.writeMsgs(fl.table, want[2:]...)

			// A producer in another language, in SQL, with a deliver-at
			// time in PostgreSQL's own JSON form.
			big := bytes.Repeat([]byte{0xde, 0xad, 0xbe, 0xef}, 40) // base64 over 76 characters
			sqlEvent := outbox.Message{ID: id(), AggregateID: "sql-1", Type: "sql.bytes", ContentType: "avro/binary", Payload: big, Topic: "from.sql"}
			ctx := context.Background()
			if fl.table {
				fn := pgx.Identifier{e.cfg.Schema, e.cfg.Table + "_write"}.Sanitize()
				if _, err := e.pool.Exec(ctx, "SELECT "+fn+"($1, $2, $3::bytea, topic => $4, content_type => $5, event_id => $6, deliver_at => now() - interval '1 hour')",
					sqlEvent.AggregateID, sqlEvent.Type, big, sqlEvent.Topic, sqlEvent.ContentType, sqlEvent.ID); err != nil {
					t.Fatal(err)
				}
			} else {
				// The documented SQL way: the log write function.
				fn, err := e.cfg.LogWriteFunc()
				if err != nil {
					t.Fatal(err)
				}
				if _, err := e.pool.Exec(ctx, `SELECT `+fn+`(json_build_object(
    'v', 1, 'event_id', $1::text, 'aggregate_id', $2::text, 'type', $3::text,
    'content_type', $4::text, 'topic', $5::text, 'deliver_at', now() - interval '1 hour',
    'payload_base64', encode($6::bytea, 'base64'))::text)`,
					sqlEvent.ID, sqlEvent.AggregateID, sqlEvent.Type, sqlEvent.ContentType, sqlEvent.Topic, big); err != nil {
					t.Fatal(err)
				}
			}
			want = append(want, sqlEvent)

			waitFor(t, 20*time.Second, "every event", func() bool { return len(pub.distinct()) == len(want) })
			got := map[string]core.Event{}
			for _, ev := range pub.events() {
				got[ev.ID] = ev
			}
			for _, m := range want {
				ev := got[m.ID]
				if ev.AggregateID != m.AggregateID || ev.Type != m.Type || ev.ContentType != m.ContentType || ev.Topic != m.Topic {
					t.Errorf("event %s published as key %q type %q content type %q topic %q, want %q %q %q %q",
						m.Type, ev.AggregateID, ev.Type, ev.ContentType, ev.Topic, m.AggregateID, m.Type, m.ContentType, m.Topic)
				}
				if !bytes.Equal(ev.Payload, m.Payload.([]byte)) {
					t.Errorf("event %s payload %q, want %q", m.Type, ev.Payload, m.Payload)
				}
				if m.Headers != nil && ev.Headers["tenant"] != "acme" {
					t.Errorf("event %s headers %v", m.Type, ev.Headers)
				}
			}
			if fl.table {
				waitFor(t, 10*time.Second, "rows marked", func() bool { return e.count("dispatched_at IS NULL") == 0 })
			}
			if c := e.count("handoff_at IS NOT NULL"); c != 0 {
				t.Errorf("%d events handed to the table, want none (the past deliver-at time included)", c)
			}
		})
	}
}

// Scheduled events are not published early: the log relay hands an event
// whose deliver-at time is still to come to the table, waiting
// (retry_at = deliver_at, as the table's trigger sets it), and the later
// events of its aggregate follow it there, as behind a poison event;
// other aggregates go on from the log. The table path publishes it when
// due, in order with those behind it, and the aggregate's next events
// come from the log again. `outbox status` and `stuck` show it as
// scheduled.
func TestScheduledEventsWaitInTheTable(t *testing.T) {
	for _, fl := range flavours {
		t.Run(fl.name, func(t *testing.T) {
			e := newEnv(t)
			e.createSlot()
			a, b := "acct_"+uuid.NewString()[:8], "acct_"+uuid.NewString()[:8]
			var mu sync.Mutex
			var firstA time.Time
			pub := &recorder{fail: func(ev *core.Event) error {
				mu.Lock()
				if ev.AggregateID == a && firstA.IsZero() {
					firstA = time.Now()
				}
				mu.Unlock()
				return nil
			}}
			o := e.opts()
			e.startPair(pub, o)

			due := time.Now().Add(3 * time.Second).Truncate(time.Microsecond)
			msg := func(agg string, n int) outbox.Message {
				return outbox.Message{AggregateID: agg, Type: "reminder.due", Payload: []byte(`{"n":` + string(rune('0'+n)) + `}`)}
			}
			scheduled := msg(a, 0)
			scheduled.DeliverAt = due
			e.writeMsgs(fl.table, scheduled)
			e.writeMsgs(fl.table, msg(a, 1), msg(b, 0))
			e.writeMsgs(fl.table, msg(b, 1))

			waitFor(t, 10*time.Second, "aggregate B from the log", func() bool {
				o, _ := firstOrder(pub.events())
				return len(o[b]) == 2
			})
			waitFor(t, 5*time.Second, "A's events in the table", func() bool {
				return e.count("handoff_at IS NOT NULL AND dispatched_at IS NULL") == 2
			})
			if c := e.count("retry_at = deliver_at AND attempts = 0 AND last_error IS NULL"); c != 1 {
				t.Fatalf("%d rows waiting for their deliver_at, want 1", c)
			}
			st, err := admin.New(e.pool, e.cfg, nil)
			if err != nil {
				t.Fatal(err)
			}
			status, err := st.Status(context.Background(), admin.StatusOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if status.Scheduled != 1 || status.Held != 0 {
				t.Errorf("status: %d scheduled, %d held, want 1 and 0", status.Scheduled, status.Held)
			}
			stuck, err := st.Stuck(context.Background(), admin.StuckOptions{IncludeScheduled: true})
			if err != nil {
				t.Fatal(err)
			}
			if len(stuck) != 1 || !stuck[0].Scheduled || !stuck[0].DeliverAt.Equal(due) || stuck[0].HeldBack != 1 {
				t.Fatalf("stuck = %+v, want A's scheduled event holding one back", stuck)
			}
			// A's next event while it waits goes to the table too.
			e.writeMsgs(fl.table, msg(a, 2))
			waitFor(t, 5*time.Second, "A's new event in the table", func() bool {
				return e.count("handoff_at IS NOT NULL AND dispatched_at IS NULL") == 3
			})

			waitFor(t, 20*time.Second, "A's events through the table", func() bool {
				o, _ := firstOrder(pub.events())
				return len(o[a]) == 3
			})
			mu.Lock()
			early := due.Sub(firstA)
			mu.Unlock()
			if early > 0 {
				t.Fatalf("A's scheduled event published %s before its deliver_at", early)
			}
			// Published is not yet marked: until the table path records
			// them, A's next event rightly follows them into the table.
			waitFor(t, 10*time.Second, "A's table rows marked", func() bool {
				return e.count("handoff_at IS NOT NULL AND dispatched_at IS NULL") == 0
			})
			e.writeMsgs(fl.table, msg(a, 3))
			waitFor(t, 10*time.Second, "A's next event from the log", func() bool {
				o, _ := firstOrder(pub.events())
				return len(o[a]) == 4
			})
			order, _ := firstOrder(pub.events())
			checkIncreasing(t, order)
			if c := e.count("handoff_at IS NOT NULL"); c != 3 {
				t.Errorf("%d rows handed to the table, want 3 (the scheduled event and the two behind it)", c)
			}
		})
	}
}

// A log-only message from another producer that breaks the table
// contract is never published: it is held in the table, unreadable, with
// the reason naming the field, under its own aggregate, so that
// aggregate's later events follow it there until an operator acts.
func TestBadMessageHoldsItsAggregate(t *testing.T) {
	e := newEnv(t)
	e.createSlot()
	pub := &recorder{}
	o := e.opts()
	e.startPair(pub, o)
	agg := "ord_" + uuid.NewString()[:8]
	prefix, _ := logrelay.MessagePrefix(e.cfg)
	id := uuid.NewString()
	if _, err := e.pool.Exec(context.Background(), `SELECT pg_logical_emit_message(true, $1, json_build_object(
    'v', 1, 'event_id', $2::text, 'aggregate_id', $3::text, 'type', 'order.placed',
    'headers', json_build_object('content-type', 'text/plain'), 'payload', '{}'::json)::text)`, prefix, id, agg); err != nil {
		t.Fatal(err)
	}
	e.writeMsgs(false, outbox.Message{AggregateID: agg, Type: "order.paid", Payload: []byte(`{"n":1}`)})
	waitFor(t, 10*time.Second, "the bad message and the one behind it in the table", func() bool {
		return e.count("handoff_at IS NOT NULL AND dispatched_at IS NULL AND aggregate_id = '"+agg+"'") == 2
	})
	if c := e.count("event_id = '" + id + "' AND type = 'outbox.unreadable' AND retry_at = 'infinity' AND last_error LIKE '%header name \"content-type\" is set by the relay%'"); c != 1 {
		t.Fatalf("%d held unreadable rows naming the reserved header, want 1", c)
	}
	time.Sleep(300 * time.Millisecond)
	if len(pub.events()) != 0 {
		t.Fatalf("published %d events, want none while the bad message is held", len(pub.events()))
	}
}

// A message that is not even text (bytes that are not UTF-8, a NUL) is
// held like any unreadable one, its bytes kept as far as text can carry
// them, and the stream goes on past it: PostgreSQL refuses such bytes in a
// text column, and a refused insert would stop the relay there for good.
func TestMessageThatIsNotTextIsHeld(t *testing.T) {
	e := newEnv(t)
	e.createSlot()
	pub := &recorder{}
	e.startPair(pub, e.opts())
	prefix, _ := logrelay.MessagePrefix(e.cfg)
	if _, err := e.pool.Exec(context.Background(), `SELECT pg_logical_emit_message(true, $1, '\x7bff007d'::bytea)`, prefix); err != nil {
		t.Fatal(err)
	}
	// Valid JSON whose event id holds a NUL, which text cannot.
	if _, err := e.pool.Exec(context.Background(), `SELECT pg_logical_emit_message(true, $1, '{"v": 1, "event_id": "a\u0000b"}')`, prefix); err != nil {
		t.Fatal(err)
	}
	e.writeMsgs(false, outbox.Message{AggregateID: "after", Type: "order.paid", Payload: []byte(`{"n":1}`)})
	waitFor(t, 10*time.Second, "the event after the message", func() bool { return len(pub.events()) == 1 })
	waitFor(t, 10*time.Second, "the message held as text", func() bool {
		return e.count("type = 'outbox.unreadable' AND retry_at = 'infinity' AND payload->>'message' = '{\ufffd\ufffd}'") == 1
	})
	waitFor(t, 10*time.Second, "the message with a NUL in its event id held", func() bool {
		return e.count("type = 'outbox.unreadable' AND retry_at = 'infinity' AND last_error LIKE '%(event_id a\ufffdb)'") == 1
	})
}

// A log-only event written while no slot reads the database would be in
// no slot's stream: the write fails in the producer's transaction, from
// LogWriter and from the SQL function, before the slot exists and after
// it is dropped; with the slot every event is delivered.
func TestLogOnlyWriteNeedsASlot(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	fn, err := e.cfg.LogWriteFunc()
	if err != nil {
		t.Fatal(err)
	}
	refused := func(when string) {
		t.Helper()
		err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
			return e.log.Write(ctx, tx, outbox.Message{AggregateID: "a", Type: "a.b", Payload: []byte(`{}`)})
		})
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "55000" || !strings.Contains(pgErr.Message, "no replication slot") {
			t.Fatalf("LogWriter %s: %v, want the write refused (55000)", when, err)
		}
		_, err = e.pool.Exec(ctx, `SELECT `+fn+`($1)`, `{"v":1}`)
		if !errors.As(err, &pgErr) || pgErr.Code != "55000" {
			t.Fatalf("SQL write %s: %v, want the write refused (55000)", when, err)
		}
	}
	refused("before the slot exists")

	e.createSlot()
	pub := &recorder{}
	run := e.start(pub, e.opts())
	var ids []string
	for i := range 20 {
		ids = append(ids, e.write(false, "a", i, 1)...)
	}
	// Twenty in one transaction: the slot is looked up once.
	ids = append(ids, e.write(false, "b", 0, 20)...)
	waitFor(t, 20*time.Second, "40 log-only events", func() bool { return len(pub.distinct()) == 40 })
	run.stop(t)
	e.dropSlot()
	refused("after the slot was dropped")
	if len(ids) != 40 {
		t.Fatalf("wrote %d", len(ids))
	}
}

// logOnlyAccepted reports whether the log-only write function accepts a
// write now.
func (e *env) logOnlyAccepted(pool *pgxpool.Pool) bool {
	e.t.Helper()
	fn, err := e.cfg.LogWriteFunc()
	if err != nil {
		e.t.Fatal(err)
	}
	_, err = pool.Exec(context.Background(), `SELECT `+fn+`($1)`, `{"v":1}`)
	var pgErr *pgconn.PgError
	if err != nil && (!errors.As(err, &pgErr) || pgErr.Code != "55000") {
		e.t.Fatalf("log-only write: %v", err)
	}
	return err == nil
}

// Another application's pgoutput slot and a publication on the table are
// not the outbox's slot: log-only writes are refused before `outbox slot
// create` and after `outbox slot drop`, whatever other slots exist. They
// used to pass with any pgoutput slot of the database.
func TestLogOnlyWriteNeedsTheOutboxsOwnSlot(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	other := "other_app_" + strings.TrimPrefix(e.cfg.Schema, "test_")
	table := pgx.Identifier{e.cfg.Schema, e.cfg.Table}.Sanitize()
	if _, err := e.pool.Exec(ctx, `CREATE PUBLICATION `+other+` FOR TABLE `+table); err != nil {
		t.Fatal(err)
	}
	if _, err := e.pool.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, other); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = e.pool.Exec(context.Background(), `SELECT pg_drop_replication_slot($1)`, other)
		_, _ = e.pool.Exec(context.Background(), `DROP PUBLICATION IF EXISTS `+other)
	})
	if e.logOnlyAccepted(e.pool) {
		t.Fatal("log-only write accepted with another application's slot and no outbox slot")
	}
	e.createSlot()
	if !e.logOnlyAccepted(e.pool) {
		t.Fatal("log-only write refused with the outbox's slot")
	}
	e.dropSlot()
	if e.logOnlyAccepted(e.pool) {
		t.Fatal("log-only write accepted after the outbox's slot was dropped, beside another application's slot")
	}
}
