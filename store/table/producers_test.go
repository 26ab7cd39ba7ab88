package table_test

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/admin"
)

func (in *instance) write(ctx context.Context, t *testing.T, msgs ...outbox.Message) {
	t.Helper()
	if err := pgx.BeginFunc(ctx, in.pool, func(tx pgx.Tx) error { return in.w.Write(ctx, tx, msgs...) }); err != nil {
		t.Fatalf("write: %v", err)
	}
}

// claimAll claims what is claimable now, completes it as done and returns
// it in claim order.
func (in *instance) claimAll(ctx context.Context, t *testing.T, unordered bool) []core.Event {
	t.Helper()
	c, err := in.s.Claim(ctx, core.ClaimOptions{Limit: 100, Unordered: unordered})
	if err != nil {
		t.Fatalf("claim: %v", err)
	}
	evs := c.Events()
	done := make([]int64, len(evs))
	for i, e := range evs {
		done[i] = e.Seq
	}
	if err := c.Complete(ctx, done, nil); err != nil {
		t.Fatalf("complete: %v", err)
	}
	return evs
}

func types(evs []core.Event) []string {
	out := make([]string, len(evs))
	for i, e := range evs {
		out[i] = e.Type
	}
	return out
}

// Any string is a key, compared byte for byte: keys that differ only in
// case are two aggregates. A failing event holds back its own key only.
func TestAnyStringKeyOrdersItsAggregate(t *testing.T) {
	ctx := context.Background()
	pool, cfg := pgtest.Schema(t)
	in := newInstance(t, pool, cfg)
	keys := []string{"ord_2Xb9", "ORD_2xb9", "9007199254740993", "kunde/ü-ß 7", "0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0d", strings.Repeat("k", event.MaxKeyBytes)}
	var msgs []outbox.Message
	for round := range 3 {
		for _, k := range keys {
			msgs = append(msgs, outbox.Message{AggregateID: k, Type: "e." + string(rune('a'+round)), Payload: []byte(`{}`)})
		}
	}
	in.write(ctx, t, msgs...)

	// Fail the first event of ord_2Xb9 with a retry an hour away.
	c, err := in.s.Claim(ctx, core.ClaimOptions{Limit: 1})
	if err != nil || len(c.Events()) != 1 || c.Events()[0].AggregateID != "ord_2Xb9" {
		t.Fatalf("first claim: %v %+v", err, c.Events())
	}
	if err := c.Complete(ctx, nil, []core.Failure{{Seq: c.Events()[0].Seq, Reason: "broker down", RetryAt: time.Now().Add(time.Hour)}}); err != nil {
		t.Fatal(err)
	}
	got := in.claimAll(ctx, t, false)
	per := map[string][]string{}
	for _, e := range got {
		per[e.AggregateID] = append(per[e.AggregateID], e.Type)
	}
	if len(per["ord_2Xb9"]) != 0 {
		t.Errorf("ord_2Xb9 published %v while its first event waits for a retry", per["ord_2Xb9"])
	}
	for _, k := range keys[1:] {
		if strings.Join(per[k], ",") != "e.a,e.b,e.c" {
			t.Errorf("key %q: claimed %v, want e.a,e.b,e.c in order", k, per[k])
		}
	}
}

// Payloads of other content types are stored and claimed byte for byte,
// an empty one included; JSON content types stay JSON.
func TestPayloadBytesAndContentType(t *testing.T) {
	ctx := context.Background()
	pool, cfg := pgtest.Schema(t)
	in := newInstance(t, pool, cfg)
	raw := []byte{0x0a, 0x03, 'a', 0xff, 0x00, 0xfe, '"', '\\', 0x80}
	in.write(ctx, t,
		outbox.Message{AggregateID: "k", Type: "p.proto", ContentType: "application/x-protobuf", Payload: raw, Topic: "payments.v2"},
		outbox.Message{AggregateID: "k", Type: "p.empty", ContentType: "application/x-protobuf", Payload: []byte{}},
		outbox.Message{AggregateID: "k", Type: "p.text", ContentType: "text/plain; charset=utf-8", Payload: "caf\u00e9\n"},
		outbox.Message{AggregateID: "k", Type: "p.json", Payload: map[string]int{"a": 1}},
		outbox.Message{AggregateID: "k", Type: "p.problem", ContentType: "application/problem+json", Payload: []byte(` {"title": "x"} `)},
	)
	got := in.claimAll(ctx, t, false)
	if len(got) != 5 {
		t.Fatalf("claimed %v", types(got))
	}
	want := []struct {
		payload     []byte
		contentType string
		topic       string
	}{
		{raw, "application/x-protobuf", "payments.v2"},
		{[]byte{}, "application/x-protobuf", ""},
		{[]byte("caf\u00e9\n"), "text/plain; charset=utf-8", ""},
		{[]byte(`{"a":1}`), "", ""},
		{[]byte(` {"title": "x"} `), "application/problem+json", ""},
	}
	for i, w := range want {
		e := got[i]
		if !bytes.Equal(e.Payload, w.payload) || e.Payload == nil || e.ContentType != w.contentType || e.Topic != w.topic {
			t.Errorf("%s: payload %q (nil %v), content type %q, topic %q; want %q, %q, %q",
				e.Type, e.Payload, e.Payload == nil, e.ContentType, e.Topic, w.payload, w.contentType, w.topic)
		}
	}
	var inJSON, inBytes int
	if err := pool.QueryRow(ctx, "SELECT count(payload), count(payload_bytes) FROM "+in.table()).Scan(&inJSON, &inBytes); err != nil {
		t.Fatal(err)
	}
	if inJSON != 2 || inBytes != 3 {
		t.Errorf("%d rows in payload, %d in payload_bytes; want 2 and 3", inJSON, inBytes)
	}
}

// The relay's byte limit covers payload_bytes as it covers JSON payloads:
// a larger row is held without its payload leaving the server.
func TestPayloadBytesOverTheEventLimitIsHeld(t *testing.T) {
	ctx := context.Background()
	pool, cfg := pgtest.SchemaWith(t, store.Config{MaxEventBytes: 1024})
	in := newInstance(t, pool, cfg)
	in.write(ctx, t,
		outbox.Message{AggregateID: "big", Type: "b.big", ContentType: "application/octet-stream", Payload: make([]byte, 2048)},
		outbox.Message{AggregateID: "small", Type: "b.small", ContentType: "application/octet-stream", Payload: make([]byte, 100)})
	c, err := in.s.Claim(ctx, core.ClaimOptions{Limit: 10})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release(ctx)
	rej := c.(core.Rejecter).Rejected()
	if len(rej) != 1 || rej[0].Event.Type != "b.big" || rej[0].Event.Payload != nil || !strings.Contains(rej[0].Err.Error(), "over the relay's limit") {
		t.Fatalf("rejected %+v, want b.big without its payload", rej)
	}
	if evs := c.Events(); len(evs) != 1 || evs[0].Type != "b.small" || len(evs[0].Payload) != 100 {
		t.Fatalf("claimed %v, want b.small", types(evs))
	}
}

// A scheduled event waits for its time. In ordered mode it holds the later
// events of its aggregate behind it, as a retry does; unordered mode lets
// them pass. Other aggregates go ahead either way.
func TestScheduledEvent(t *testing.T) {
	for _, unordered := range []bool{false, true} {
		name := "ordered"
		if unordered {
			name = "unordered"
		}
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			pool, cfg := pgtest.Schema(t)
			in := newInstance(t, pool, cfg)
			at := time.Now().Add(1500 * time.Millisecond)
			in.write(ctx, t,
				outbox.Message{AggregateID: "a", Type: "a.scheduled", Payload: []byte(`{}`), DeliverAt: at},
				outbox.Message{AggregateID: "a", Type: "a.later", Payload: []byte(`{}`)},
				outbox.Message{AggregateID: "b", Type: "b.now", Payload: []byte(`{}`)},
				outbox.Message{AggregateID: "c", Type: "c.past", Payload: []byte(`{}`), DeliverAt: time.Now().Add(-time.Minute)},
			)
			st, err := in.ad.Status(ctx, admin.StatusOptions{StuckAfter: time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			if st.Scheduled != 1 || st.Retrying != 0 || st.Pending != 4 {
				t.Errorf("status: %d scheduled, %d retrying, %d pending; want 1, 0, 4", st.Scheduled, st.Retrying, st.Pending)
			}
			time.Sleep(5 * time.Millisecond)
			stuck, err := in.ad.Stuck(ctx, admin.StuckOptions{OlderThan: time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			var listed []string
			for _, e := range stuck {
				listed = append(listed, e.Type)
			}
			if strings.Join(listed, ",") != "a.later,b.now,c.past" {
				t.Errorf("stuck lists %v, want the due events and not the scheduled one", listed)
			}
			if st.OldestPending.IsZero() {
				t.Error("status shows no oldest pending event")
			}
			sched, err := in.ad.Stuck(ctx, admin.StuckOptions{OlderThan: time.Hour, IncludeScheduled: true})
			if err != nil {
				t.Fatal(err)
			}
			if len(sched) != 1 || !sched[0].Scheduled || sched[0].DeliverAt.IsZero() || !sched[0].RetryAt.IsZero() {
				t.Errorf("stuck --scheduled = %+v, want a.scheduled with its deliver-at time", sched)
			}
			if n, err := in.ad.Retry(ctx, admin.Selector{AggregateID: "a"}); err != nil || n != 0 {
				t.Errorf("retry released %d scheduled events (%v); it must leave them waiting", n, err)
			}

			got := strings.Join(types(in.claimAll(ctx, t, unordered)), ",")
			want := "b.now,c.past"
			if unordered {
				want = "a.later,b.now,c.past"
			}
			if got != want {
				t.Fatalf("before its time: claimed %s, want %s", got, want)
			}
			time.Sleep(time.Until(at) + 50*time.Millisecond)
			got = strings.Join(types(in.claimAll(ctx, t, unordered)), ",")
			want = "a.scheduled,a.later"
			if unordered {
				want = "a.scheduled"
			}
			if got != want {
				t.Fatalf("after its time: claimed %s, want %s", got, want)
			}
		})
	}
}

// Parking a scheduled event and unparking it returns it to its time.
func TestUnparkedScheduledEventWaitsForItsTime(t *testing.T) {
	ctx := context.Background()
	pool, cfg := pgtest.Schema(t)
	in := newInstance(t, pool, cfg)
	in.write(ctx, t, outbox.Message{AggregateID: "a", Type: "a.s", Payload: []byte(`{}`), DeliverAt: time.Now().Add(time.Hour)})
	if _, err := in.ad.Park(ctx, admin.Selector{AggregateID: "a"}, "look"); err != nil {
		t.Fatal(err)
	}
	if _, err := in.ad.Unpark(ctx, admin.Selector{AggregateID: "a"}); err != nil {
		t.Fatal(err)
	}
	if got := in.claimAll(ctx, t, false); len(got) != 0 {
		t.Fatalf("unparked scheduled event claimed before its time: %v", types(got))
	}
}

// The table refuses what the writer refuses, for producers that insert
// rows themselves; each check is named in the error.
func TestTableChecksOfMigration7(t *testing.T) {
	ctx := context.Background()
	pool, cfg := pgtest.Schema(t)
	in := newInstance(t, pool, cfg)
	table := in.cfg.Table
	for _, tc := range []struct {
		name, cols, vals, check string
	}{
		{"empty key", "aggregate_id, type, payload", "'', 't', '{}'", "_key_check"},
		{"long key", "aggregate_id, type, payload", "repeat('k', 256), 't', '{}'", "_key_check"},
		{"control in key", "aggregate_id, type, payload", "E'a\\x01', 't', '{}'", "_key_check"},
		{"no payload", "aggregate_id, type", "'k', 't'", "_payload_check"},
		{"both payloads", "aggregate_id, type, payload, payload_bytes, content_type", "'k', 't', '{}', '\\x00', 'application/json'", "_payload_check"},
		{"bytes without a content type", "aggregate_id, type, payload_bytes", "'k', 't', '\\x00'", "_payload_check"},
		{"bytes of a json type", "aggregate_id, type, payload_bytes, content_type", "'k', 't', 'x', 'application/vnd.a+json'", "_payload_check"},
		{"json of a binary type", "aggregate_id, type, payload, content_type", "'k', 't', '{}', 'application/x-protobuf'", "_payload_check"},
		{"bad content type", "aggregate_id, type, payload_bytes, content_type", "'k', 't', 'x', 'protobuf'", "_ctype_check"},
		{"topic with space", "aggregate_id, type, payload, topic", "'k', 't', '{}', 'a b'", "_topic_check"},
		{"empty topic", "aggregate_id, type, payload, topic", "'k', 't', '{}', ''", "_topic_check"},
		{"infinite deliver_at", "aggregate_id, type, payload, deliver_at", "'k', 't', '{}', 'infinity'", "_deliver_check"},
		{"reserved header", "aggregate_id, type, payload, headers", "'k', 't', '{}', '{\"content-type\": \"x\"}'", "_reserved_check"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := pool.Exec(ctx, "INSERT INTO "+in.table()+" ("+tc.cols+") VALUES ("+tc.vals+")")
			if err == nil || !strings.Contains(err.Error(), tc.check) {
				t.Fatalf("err = %v, want the %s check to refuse the row", err, tc.check)
			}
			// As PostgreSQL reports a check: clients match on the code and
			// the constraint field, people read what the rule wants after
			// its name.
			var pgErr *pgconn.PgError
			named := `"` + table + tc.check + `": `
			if !errors.As(err, &pgErr) || pgErr.Code != "23514" || pgErr.ConstraintName != table+tc.check || pgErr.TableName != table ||
				!strings.Contains(pgErr.Message, named) || len(pgErr.Message) < strings.Index(pgErr.Message, named)+len(named)+10 {
				t.Fatalf("err = %#v, want SQLSTATE 23514 naming constraint %s%s and saying what it wants", err, table, tc.check)
			}
		})
	}
	// A direct insert with deliver_at is scheduled by the table's trigger.
	if _, err := pool.Exec(ctx, "INSERT INTO "+in.table()+" (aggregate_id, type, payload, deliver_at) VALUES ('k', 't.s', '{}', now() + interval '1 hour')"); err != nil {
		t.Fatal(err)
	}
	if got := in.claimAll(ctx, t, true); len(got) != 0 {
		t.Fatalf("a row inserted with a future deliver_at was claimed: %v", types(got))
	}
}

// A scheduled event holds back the events of its aggregate after it, not
// the ones before it: those are due and go out, in order, ahead of it. A
// retry-waiting event does the same. Events of other aggregates pass.
func TestScheduledEventHoldsOnlyLaterEvents(t *testing.T) {
	ctx := context.Background()
	pool, cfg := pgtest.Schema(t)
	in := newInstance(t, pool, cfg)
	var msgs []outbox.Message
	for range 100 {
		msgs = append(msgs, outbox.Message{AggregateID: "ord_1", Type: "a.before", Payload: []byte(`{}`)})
	}
	msgs = append(msgs, outbox.Message{AggregateID: "ord_1", Type: "a.scheduled", Payload: []byte(`{}`), DeliverAt: time.Now().Add(2 * time.Hour)})
	msgs = append(msgs, outbox.Message{AggregateID: "ord_1", Type: "a.after", Payload: []byte(`{}`)})
	for range 10 {
		msgs = append(msgs, outbox.Message{AggregateID: "ord_2", Type: "b.other", Payload: []byte(`{}`)})
	}
	in.write(ctx, t, msgs...)
	// A retry-waiting event in the middle of a third aggregate.
	in.write(ctx, t,
		outbox.Message{AggregateID: "ord_3", Type: "c.before", Payload: []byte(`{}`)},
		outbox.Message{AggregateID: "ord_3", Type: "c.failed", Payload: []byte(`{}`)},
		outbox.Message{AggregateID: "ord_3", Type: "c.after", Payload: []byte(`{}`)})
	if _, err := pool.Exec(ctx, `UPDATE `+in.table()+` SET attempts = 1, retry_at = now() + interval '1 hour', last_error = 'timeout' WHERE type = 'c.failed'`); err != nil {
		t.Fatal(err)
	}

	// The operator's view says the same: the due events wait for nothing
	// unusual, the later ones for the scheduled event, which waits for its
	// time alone.
	time.Sleep(5 * time.Millisecond)
	stuck, err := in.ad.Stuck(ctx, admin.StuckOptions{OlderThan: time.Millisecond, IncludeScheduled: true, Limit: 500})
	if err != nil {
		t.Fatal(err)
	}
	var first, second, sched, after, cFailed, cAfter admin.StuckEvent
	for _, e := range stuck {
		switch {
		case e.Type == "a.before" && first.Seq == 0:
			first = e
		case e.Type == "a.before" && second.Seq == 0:
			second = e
		case e.Type == "a.scheduled":
			sched = e
		case e.Type == "a.after":
			after = e
		case e.Type == "c.failed":
			cFailed = e
		case e.Type == "c.after":
			cAfter = e
		}
	}
	if first.WaitsFor != 0 || first.HeldBack != 99 || second.WaitsFor != first.Seq {
		t.Errorf("first due event waits for %d and holds back %d, the second waits for %d; want 0, 99 (the due ones) and %d",
			first.WaitsFor, first.HeldBack, second.WaitsFor, first.Seq)
	}
	if !sched.Scheduled || sched.WaitsFor != 0 || sched.HeldBack != 1 || after.WaitsFor != sched.Seq {
		t.Errorf("scheduled event %+v, the one after it waits for %d; want scheduled, waiting for nothing, holding back 1, and %d",
			sched, after.WaitsFor, sched.Seq)
	}
	if cFailed.RetryAt.IsZero() || cFailed.WaitsFor != 0 || cFailed.HeldBack != 1 || cAfter.WaitsFor != cFailed.Seq {
		t.Errorf("retrying event %+v, the one after it waits for %d; want %d", cFailed, cAfter.WaitsFor, cFailed.Seq)
	}
	info, err := in.ad.Event(ctx, first.Seq, "")
	if err != nil || info.WaitsFor != 0 || info.HeldBack != 99 || info.State() != admin.StatePending {
		t.Errorf("event %d: %+v, %v; want pending, waiting for nothing, holding back 99", first.Seq, info.EventInfo, err)
	}

	count := map[string]int{}
	for _, e := range in.claimAll(ctx, t, false) {
		count[e.Type]++
	}
	for _, e := range in.claimAll(ctx, t, false) {
		count[e.Type]++
	}
	want := map[string]int{"a.before": 100, "b.other": 10, "c.before": 1}
	if len(count) != len(want) || count["a.before"] != 100 || count["b.other"] != 10 || count["c.before"] != 1 {
		t.Fatalf("claimed %v, want %v: the events before a waiting one are due, those after it wait", count, want)
	}
}
