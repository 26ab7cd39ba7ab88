package event_test

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/outboxhq/outbox/core/event"
)

const id = "0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0d"

// Every refusal names the field, in the error's Field and in its text.
func TestCheckFields(t *testing.T) {
	type fields struct {
		key, typ, ct, topic string
		at                  time.Time
	}
	ok := fields{key: "ord_2Xb9", typ: "order.placed"}
	with := func(f func(*fields)) fields { v := ok; f(&v); return v }
	for _, tc := range []struct {
		name  string
		in    fields
		field string // "" when accepted
		want  string
	}{
		{"plain", ok, "", ""},
		{"any key", with(func(f *fields) { f.key = "kunde/ü-ß 7" }), "", ""},
		{"key of 255 bytes", with(func(f *fields) { f.key = strings.Repeat("k", event.MaxKeyBytes) }), "", ""},
		{"every optional field", with(func(f *fields) {
			f.ct, f.topic, f.at = "application/json; charset=utf-8", "billing", time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
		}), "", ""},
		{"empty key", with(func(f *fields) { f.key = "" }), "aggregate_id", "aggregate_id is empty"},
		{"key over 255 bytes", with(func(f *fields) { f.key = strings.Repeat("k", 256) }), "aggregate_id", "aggregate_id is 256 bytes, over the limit of 255"},
		{"key not UTF-8", with(func(f *fields) { f.key = "a\xff" }), "aggregate_id", "not valid UTF-8"},
		{"key with a control character", with(func(f *fields) { f.key = "a\x01" }), "aggregate_id", "control character"},
		{"empty type", with(func(f *fields) { f.typ = "" }), "type", "type is empty"},
		{"type with a space", with(func(f *fields) { f.typ = "order placed" }), "type", `type "order placed" contains whitespace`},
		{"type over 255 bytes", with(func(f *fields) { f.typ = strings.Repeat("t", 256) }), "type", "type is 256 bytes"},
		{"type not UTF-8", with(func(f *fields) { f.typ = "t\xff" }), "type", "not valid UTF-8"},
		{"content type not a media type", with(func(f *fields) { f.ct = "protobuf" }), "content_type", `content_type "protobuf" is not a media type`},
		{"content type with a newline", with(func(f *fields) { f.ct = "text/plain\n" }), "content_type", "not a media type"},
		{"content type over 255 bytes", with(func(f *fields) { f.ct = "a/" + strings.Repeat("b", 254) }), "content_type", "over the limit of 255"},
		{"topic with a space", with(func(f *fields) { f.topic = "a b" }), "topic", `topic "a b" contains whitespace`},
		{"topic over 255 bytes", with(func(f *fields) { f.topic = strings.Repeat("t", 256) }), "topic", "over the limit of 255"},
		{"deliver_at past PostgreSQL", with(func(f *fields) { f.at = time.Date(300000, 1, 1, 0, 0, 0, 0, time.UTC) }), "deliver_at", "out of PostgreSQL's range"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := event.CheckFields(tc.in.key, tc.in.typ, tc.in.ct, tc.in.topic, tc.in.at)
			checkFieldError(t, err, tc.field, tc.want)
		})
	}
}

func checkFieldError(t *testing.T, err error, field, want string) {
	t.Helper()
	if field == "" {
		if err != nil {
			t.Fatalf("refused: %v", err)
		}
		return
	}
	var fe *event.FieldError
	if !errors.As(err, &fe) {
		t.Fatalf("error %v, want a *FieldError", err)
	}
	if fe.Field != field || !strings.HasPrefix(fe.Msg, field) || !strings.Contains(err.Error(), want) {
		t.Fatalf("error %q names field %q, want field %q and text containing %q", err, fe.Field, field, want)
	}
}

func TestEncodeHeaders(t *testing.T) {
	for _, tc := range []struct {
		name    string
		headers map[string]string
		want    string // "" when accepted
	}{
		{"none", nil, ""},
		{"trace context", map[string]string{"traceparent": "00-abc-def-01", "tenant": "ü"}, ""},
		{"empty name", map[string]string{"": "x"}, "headers have an empty name"},
		{"NUL in a value", map[string]string{"k": "a\x00b"}, `headers: header "k" is not valid UTF-8 or has a NUL character`},
		{"invalid UTF-8 in a name", map[string]string{"k\xff": "v"}, "not valid UTF-8"},
		{"over 64 KiB as JSON", map[string]string{"k": strings.Repeat("v", event.MaxHeadersBytes)}, "over the limit of 65536"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := event.EncodeHeaders(tc.headers)
			if tc.want == "" {
				if err != nil || (len(tc.headers) > 0) != (b != nil) {
					t.Fatalf("EncodeHeaders = %s, %v", b, err)
				}
				return
			}
			checkFieldError(t, err, "headers", tc.want)
		})
	}
	// Every name the relay sets is refused.
	for _, h := range event.ReservedHeaders {
		_, err := event.EncodeHeaders(map[string]string{h: "x"})
		checkFieldError(t, err, "headers", `header name "`+h+`" is set by the relay`)
	}
}

func TestCheckPayload(t *testing.T) {
	for _, tc := range []struct {
		name, ct string
		payload  string
		max      int
		want     string // "" when accepted
	}{
		{"json", "", `{"a":1}`, 64, ""},
		{"json at the limit", "", `"` + strings.Repeat("x", 62) + `"`, 64, ""},
		{"json over the limit", "", `"` + strings.Repeat("x", 63) + `"`, 64, "payload is 65 bytes, over the limit of 64"},
		{"not json", "application/problem+json", `nope`, 64, "payload is not valid JSON"},
		{"empty json", "", ``, 64, "payload is not valid JSON"},
		{"json not UTF-8", "", "\"\xff\"", 64, "payload is not valid UTF-8"},
		{"bytes", "application/x-protobuf", "\xff\x00", 64, ""},
		{"empty bytes", "avro/binary", "", 64, ""},
		{"bytes over the limit", "avro/binary", strings.Repeat("x", 65), 64, "payload is 65 bytes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := event.CheckPayload(tc.ct, []byte(tc.payload), tc.max)
			if tc.want == "" {
				checkFieldError(t, err, "", "")
				return
			}
			checkFieldError(t, err, "payload", tc.want)
		})
	}
}

func TestParseID(t *testing.T) {
	if got, err := event.ParseID(strings.ToUpper(id)); err != nil || got != id {
		t.Errorf("ParseID(upper case) = %q, %v; want the canonical form", got, err)
	}
	if _, err := event.ParseID("abc"); err == nil || err.Error() != `"abc" is not a UUID` || !errors.Is(err, event.ErrNotUUID) {
		t.Errorf("ParseID(abc) = %v, want one wrapping ErrNotUUID", err)
	}
	if _, err := event.ParseID(strings.Repeat("x", 100)); err == nil || !strings.Contains(err.Error(), "...") {
		t.Errorf("a long id is not cut in the error: %v", err)
	}
}

func TestTruncate(t *testing.T) {
	for _, tc := range []struct {
		s    string
		n    int
		want string
	}{
		{"abc", 5, "abc"}, {"abc", 3, "abc"}, {"abcd", 3, "abc"},
		{"aé", 2, "a"}, // é is two bytes: not split
		{"aé", 3, "aé"}, {"€", 2, ""}, {"", 0, ""},
	} {
		if got := event.Truncate(tc.s, tc.n); got != tc.want {
			t.Errorf("Truncate(%q, %d) = %q, want %q", tc.s, tc.n, got, tc.want)
		}
	}
}

func TestIsJSON(t *testing.T) {
	for ct, want := range map[string]bool{
		"": true, "application/json": true, "Application/JSON; charset=utf-8": true, "application/problem+json": true,
		"application/x-protobuf": false, "text/plain": false, "application/jsonx": false,
	} {
		if got := event.IsJSON(ct); got != want {
			t.Errorf("IsJSON(%q) = %v, want %v", ct, got, want)
		}
	}
}

// The check of a stored row: size first, then type, then headers.
func TestCheckRow(t *testing.T) {
	str := func(s string) *string { return &s }
	for _, tc := range []struct {
		name    string
		typ     string
		headers *string
		size    int64
		want    string // "" when accepted
		header  string // a header the decoded map holds
	}{
		{"plain", "a.b", nil, 10, "", ""},
		{"null headers", "a.b", str("null"), 10, "", ""},
		{"headers", "a.b", str(`{"k":"v"}`), 10, "", "k"},
		{"at the limit", "a.b", nil, 100, "", ""},
		{"over the limit", "a.b", nil, 101, "payload and headers are 101 bytes, over the relay's limit of 100", ""},
		{"empty type", "", nil, 10, "type is empty", ""},
		{"type with a space", "a b", nil, 10, "whitespace or a control character", ""},
		{"headers not an object", "a.b", str(`[1]`), 10, "headers are not a JSON object of strings: [1]", ""},
		{"header not a string", "a.b", str(`{"n":1}`), 10, "headers are not a JSON object of strings", ""},
		{"headers over 64 KiB", "a.b", str(`{"k":"` + strings.Repeat("v", event.MaxHeadersBytes) + `"}`), 10, "over the limit of 65536", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, err := event.CheckRow(tc.typ, tc.headers, tc.size, 100)
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			case tc.header != "" && h[tc.header] == "":
				t.Fatalf("headers decoded as %v", h)
			}
		})
	}
}

// A message survives the round trip field for field; payloads byte for
// byte, JSON ones with their own spacing.
func TestMessageRoundTrip(t *testing.T) {
	for _, m := range []event.Message{
		{ID: id, AggregateID: "k", Type: "t", Payload: []byte(`{ "a" : [1, 2] }`)},
		{ID: id, AggregateID: "kunde/ü 7", Type: "t", ContentType: "application/x-protobuf", Payload: []byte{0, 0xff}},
		{ID: id, AggregateID: "k", Type: "t", ContentType: "avro/binary", Payload: []byte{}},
		{ID: id, AggregateID: "k", Type: "t", Topic: "billing", Headers: map[string]string{"a": "b"},
			DeliverAt: time.Date(2030, 1, 2, 3, 4, 5, 123456000, time.UTC), Payload: []byte(`"x"`)},
	} {
		b, err := event.EncodeMessage(m)
		if err != nil {
			t.Fatalf("encode %+v: %v", m, err)
		}
		got, err := event.DecodeMessage(b)
		if err != nil {
			t.Fatalf("decode %s: %v", b, err)
		}
		if got.ID != m.ID || got.AggregateID != m.AggregateID || got.Type != m.Type || got.ContentType != m.ContentType ||
			got.Topic != m.Topic || !got.DeliverAt.Equal(m.DeliverAt) || len(got.Headers) != len(m.Headers) ||
			!bytes.Equal(got.Payload, m.Payload) || got.Payload == nil {
			t.Errorf("round trip of %+v gave %+v", m, got)
		}
	}
}

// EncodeMessage refuses only what its format cannot carry, naming the
// field; DecodeMessage applies the same field rules as CheckFields.
func TestMessageRefusals(t *testing.T) {
	_, err := event.EncodeMessage(event.Message{ID: id, AggregateID: "k", Type: "t", DeliverAt: time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC), Payload: []byte(`{}`)})
	checkFieldError(t, err, "deliver_at", "outside the years 0 to 9999")
	_, err = event.EncodeMessage(event.Message{ID: id, AggregateID: "k", Type: "t", Payload: []byte(`{`)})
	checkFieldError(t, err, "payload", "not valid JSON")

	_, err = event.DecodeMessage([]byte(`{"v":1,"event_id":"` + id + `","aggregate_id":"k","type":"t","topic":"a b","payload":{}}`))
	checkFieldError(t, err, "topic", `event message: topic "a b" contains whitespace`)
	_, err = event.DecodeMessage([]byte(`{"v":1,"event_id":"` + id + `","aggregate_id":"k","type":"t","payload":"` + "\xff" + `"}`))
	checkFieldError(t, err, "payload", "event message: payload is not valid UTF-8")
}

func TestMessagePrefix(t *testing.T) {
	if got := event.MessagePrefix("public", "events_outbox"); got != "outbox:public.events_outbox" {
		t.Errorf("MessagePrefix = %q", got)
	}
}
