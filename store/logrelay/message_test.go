package logrelay_test

import (
	"bytes"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/outboxhq/outbox/core/event"
)

// Every field of the table contract survives the message format: any
// key, JSON payloads byte for byte, other content types' bytes (empty and
// non-UTF-8 among them), the topic, the deliver-at time and headers.
func TestMessageRoundTrip(t *testing.T) {
	at := time.Date(2031, 2, 3, 4, 5, 6, 789000, time.UTC)
	for _, m := range []event.Message{
		// The JSON value's own bytes, spacing and key order kept; the
		// format cannot keep whitespace around the value.
		{ID: "0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0d", AggregateID: "ord_2Xb9", Type: "order.placed", Payload: []byte("{\"b\" : 1,\n \"a\":2.50}")},
		{ID: "0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0d", AggregateID: "42", Type: "order.placed", ContentType: "application/cloudevents+json; charset=utf-8", Payload: []byte(`[1]`)},
		{
			ID: "0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0d", AggregateID: "inv_8Hq2", Type: "invoice.due",
			ContentType: "application/x-protobuf", Topic: "billing.reminders", DeliverAt: at,
			Headers: map[string]string{"tenant": "acme", "traceparent": "00-x"}, Payload: []byte{0x0a, 0x03, 0xff, 0x00, '"'},
		},
		{ID: "0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0d", AggregateID: "k", Type: "t", ContentType: "application/octet-stream", Payload: []byte{}},
	} {
		b, err := event.EncodeMessage(m)
		if err != nil {
			t.Fatalf("encode %+v: %v", m, err)
		}
		got, err := event.DecodeMessage(b)
		if err != nil {
			t.Fatalf("decode %s: %v", b, err)
		}
		if !got.DeliverAt.Equal(m.DeliverAt) {
			t.Errorf("deliver_at %v, want %v", got.DeliverAt, m.DeliverAt)
		}
		got.DeliverAt = m.DeliverAt
		if got.Payload == nil || !bytes.Equal(got.Payload, m.Payload) {
			t.Errorf("payload %q, want %q", got.Payload, m.Payload)
		}
		if !reflect.DeepEqual(got, m) {
			t.Errorf("decoded %+v, want %+v", got, m)
		}
	}
	far := event.Message{ID: "0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0d", AggregateID: "k", Type: "t", Payload: []byte(`{}`), DeliverAt: time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)}
	var ee *event.FieldError
	if _, err := event.EncodeMessage(far); !errors.As(err, &ee) || ee.Field != "deliver_at" {
		t.Errorf("encode year 10000: %v, want a FieldError naming deliver_at", err)
	}
	if _, err := event.EncodeMessage(event.Message{ID: far.ID, AggregateID: "k", Type: "t", Payload: []byte(`{`)}); !errors.As(err, &ee) || ee.Field != "payload" {
		t.Errorf("encode a JSON payload that is not JSON: %v, want a FieldError naming payload", err)
	}
}

// Messages written by other producers (SQL's json_build_object) are
// checked as outbox.Writer checks rows; the error names the field.
func TestDecodeMessageRefuses(t *testing.T) {
	const id = `"event_id":"0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0d"`
	for _, tc := range []struct{ content, want string }{
		{`not json`, "not the outbox's JSON object"},
		{`{"v":2,` + id + `,"aggregate_id":"k","type":"t","payload":{}}`, "version 2"},
		{`{"v":1,"aggregate_id":"k","type":"t","payload":{}}`, "no event_id"},
		{`{"v":1,"event_id":"abc","aggregate_id":"k","type":"t","payload":{}}`, "event_id \"abc\" is not a UUID"},
		{`{"v":1,` + id + `,"type":"t","payload":{}}`, "aggregate_id is empty"},
		{`{"v":1,` + id + `,"aggregate_id":"a\u0001","type":"t","payload":{}}`, "aggregate_id contains a control character"},
		{`{"v":1,` + id + `,"aggregate_id":"` + strings.Repeat("k", 256) + `","type":"t","payload":{}}`, "aggregate_id is 256 bytes"},
		{`{"v":1,` + id + `,"aggregate_id":"k","type":"a b","payload":{}}`, "type"},
		{`{"v":1,` + id + `,"aggregate_id":"k","type":"t","content_type":"protobuf","payload_base64":""}`, "content_type \"protobuf\""},
		{`{"v":1,` + id + `,"aggregate_id":"k","type":"t","topic":"a b","payload":{}}`, "topic \"a b\""},
		{`{"v":1,` + id + `,"aggregate_id":"k","type":"t","deliver_at":"tomorrow","payload":{}}`, "not the outbox's JSON object"},
		{`{"v":1,` + id + `,"aggregate_id":"k","type":"t","headers":{"content-type":"x"},"payload":{}}`, `header name "content-type" is set by the relay`},
		{`{"v":1,` + id + `,"aggregate_id":"k","type":"t","headers":{"":"x"},"payload":{}}`, "empty name"},
		{`{"v":1,` + id + `,"aggregate_id":"k","type":"t","headers":{"k":"a\u0000"},"payload":{}}`, "NUL"},
		{`{"v":1,` + id + `,"aggregate_id":"k","type":"t","headers":{"k":1},"payload":{}}`, "not the outbox's JSON object"},
		{`{"v":1,` + id + `,"aggregate_id":"k","type":"t"}`, "has no payload"},
		{`{"v":1,` + id + `,"aggregate_id":"k","type":"t","payload":null}`, "has no payload"},
		{`{"v":1,` + id + `,"aggregate_id":"k","type":"t","payload_base64":"AA=="}`, "the payload goes in payload"},
		{`{"v":1,` + id + `,"aggregate_id":"k","type":"t","content_type":"avro/binary","payload":{}}`, "the payload goes in payload_base64"},
		{`{"v":1,` + id + `,"aggregate_id":"k","type":"t","content_type":"avro/binary"}`, "no payload_base64"},
		{`{"v":1,` + id + `,"aggregate_id":"k","type":"t","content_type":"avro/binary","payload_base64":"%%"}`, "payload_base64 is not base64"},
	} {
		m, err := event.DecodeMessage([]byte(tc.content))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("decode %.80s: %v, want an error containing %q", tc.content, err, tc.want)
		}
		if m.Payload != nil {
			t.Errorf("decode %.80s: a refused message has a payload", tc.content)
		}
	}
	// The fields read are kept with the error, so the event can be named.
	m, _ := event.DecodeMessage([]byte(`{"v":1,` + id + `,"aggregate_id":"ord_1","type":"t","topic":"a b","payload":{}}`))
	if m.ID != "0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0d" || m.AggregateID != "ord_1" {
		t.Errorf("refused message read as %+v", m)
	}
	// PostgreSQL's encode(..., 'base64') breaks lines every 76 characters.
	payload := bytes.Repeat([]byte{0xde, 0xad, 0xbe, 0xef}, 30)
	wrapped := "3q2+796tvu/erb7v3q2+796tvu/erb7v3q2+796tvu/erb7v3q2+796tvu/erb7v3q2+796tvu/e\nrb7v3q2+796tvu/erb7v3q2+796tvu/erb7v3q2+796tvu/erb7v3q2+796tvu/erb7v3q2+796t\nvu/erb7v"
	m, err := event.DecodeMessage([]byte(`{"v":1,` + id + `,"aggregate_id":"k","type":"t","content_type":"application/x-protobuf","payload_base64":"` + strings.ReplaceAll(wrapped, "\n", `\n`) + `"}`))
	if err != nil || !bytes.Equal(m.Payload, payload) {
		t.Errorf("wrapped base64: %v, payload %x", err, m.Payload)
	}
}
