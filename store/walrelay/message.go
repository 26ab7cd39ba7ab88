package walrelay

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"

	"github.com/outboxhq/outbox/store"
)

// MessageVersion is the version of the message encoding EncodeMessage
// writes and the relay reads.
const MessageVersion = 1

// Message is one event as a log-only producer emits it: the fields of a
// row of the outbox table (see docs/producers.md for the table contract).
type Message struct {
	ID          string // the event's identity (a UUID)
	AggregateID string // ordering and partition key, as store.CheckKey accepts
	Type        string // such as "order.placed"
	// ContentType is the payload's media type; empty means
	// application/json.
	ContentType string
	// Topic, when set, is where the event goes instead of the routing's
	// choice.
	Topic string
	// DeliverAt, when not zero, is the time before which the event is
	// not published.
	DeliverAt time.Time
	Headers   map[string]string // may be nil
	// Payload is published exactly as given: JSON for a JSON content type
	// (store.IsJSON), any bytes for another.
	Payload []byte
}

// wireMessage is the encoding of a Message: one JSON object per
// pg_logical_emit_message call, so producers writing SQL can build it with
// json_build_object:
//
//	{"v":1,"event_id":"0190...","aggregate_id":"ord_2Xb9","type":"order.placed",
//	 "content_type":"application/x-protobuf","topic":"billing",
//	 "deliver_at":"2030-01-02T15:04:05.123456Z","headers":{"k":"v"},
//	 "payload_base64":"CgNhYmM="}
//
// A JSON payload (no content_type, or a JSON one) is embedded as is under
// "payload"; any other goes base64-encoded (standard alphabet, padded;
// line breaks such as PostgreSQL's encode(..., 'base64') writes are
// ignored) under "payload_base64". Exactly one of the two is present.
// content_type, topic, deliver_at (RFC 3339) and headers may be absent.
type wireMessage struct {
	V             int               `json:"v"`
	ID            string            `json:"event_id"`
	AggregateID   string            `json:"aggregate_id"`
	Type          string            `json:"type"`
	ContentType   string            `json:"content_type"`
	Topic         string            `json:"topic"`
	DeliverAt     *time.Time        `json:"deliver_at"`
	Headers       map[string]string `json:"headers"`
	Payload       json.RawMessage   `json:"payload"`
	PayloadBase64 *string           `json:"payload_base64"`
}

// EncodeError names the field of a Message the encoding cannot carry.
type EncodeError struct {
	Field string // "payload", "headers" or "deliver_at"
	Msg   string
}

func (e *EncodeError) Error() string { return "encode event message: " + e.Field + " " + e.Msg }

// EncodeMessage returns the content of the logical decoding message that
// carries m. A JSON payload goes in byte for byte (encoding/json would
// compact it), so consumers receive what the producer wrote; only
// whitespace around the JSON value is not kept. The caller
// has checked m's fields (outbox.LogWriter does, as outbox.Writer checks
// rows); EncodeMessage refuses, with an *EncodeError, only what its
// format cannot carry: a JSON content type with a payload that is not
// JSON, or a DeliverAt outside the years 0 to 9999 of RFC 3339.
func EncodeMessage(m Message) ([]byte, error) {
	jsonPayload := store.IsJSON(m.ContentType)
	if jsonPayload && !json.Valid(m.Payload) {
		return nil, &EncodeError{Field: "payload", Msg: "is not valid JSON"}
	}
	b := make([]byte, 0, base64.StdEncoding.EncodedLen(len(m.Payload))+len(m.Type)+len(m.AggregateID)+192)
	b = append(b, `{"v":1,"event_id":`...)
	b = appendString(b, m.ID)
	b = append(b, `,"aggregate_id":`...)
	b = appendString(b, m.AggregateID)
	b = append(b, `,"type":`...)
	b = appendString(b, m.Type)
	if m.ContentType != "" {
		b = append(b, `,"content_type":`...)
		b = appendString(b, m.ContentType)
	}
	if m.Topic != "" {
		b = append(b, `,"topic":`...)
		b = appendString(b, m.Topic)
	}
	if !m.DeliverAt.IsZero() {
		t, err := m.DeliverAt.UTC().MarshalJSON()
		if err != nil {
			return nil, &EncodeError{Field: "deliver_at", Msg: fmt.Sprintf("%s is outside the years 0 to 9999 of RFC 3339", m.DeliverAt.UTC().Format(time.DateTime))}
		}
		b = append(b, `,"deliver_at":`...)
		b = append(b, t...)
	}
	if len(m.Headers) > 0 {
		h, err := json.Marshal(m.Headers)
		if err != nil {
			return nil, &EncodeError{Field: "headers", Msg: err.Error()}
		}
		b = append(b, `,"headers":`...)
		b = append(b, h...)
	}
	if jsonPayload {
		b = append(b, `,"payload":`...)
		b = append(b, m.Payload...)
	} else {
		b = append(b, `,"payload_base64":"`...)
		b = base64.StdEncoding.AppendEncode(b, m.Payload)
		b = append(b, '"')
	}
	return append(b, '}'), nil
}

func appendString(b []byte, s string) []byte {
	q, _ := json.Marshal(s) // a string always marshals
	return append(b, q...)
}

// DecodeMessage reads content written by EncodeMessage (or by SQL in the
// same format) and checks what outbox.Writer checks of a row: the error
// names the field at fault. When the error comes after the JSON object
// was read, the returned Message holds the fields as read, so the caller
// can still name the event.
func DecodeMessage(content []byte) (Message, error) {
	var w wireMessage
	if err := json.Unmarshal(content, &w); err != nil {
		return Message{}, fmt.Errorf("event message is not the outbox's JSON object: %w", err)
	}
	m := Message{ID: w.ID, AggregateID: w.AggregateID, Type: w.Type, ContentType: w.ContentType, Topic: w.Topic, Headers: w.Headers}
	if w.DeliverAt != nil {
		m.DeliverAt = *w.DeliverAt
	}
	bad := func(format string, a ...any) (Message, error) {
		return m, fmt.Errorf("event message: "+format, a...)
	}
	if w.V != MessageVersion {
		return bad("version %d is not %d", w.V, MessageVersion)
	}
	if w.ID == "" {
		return bad("has no event_id")
	}
	if _, err := uuid.Parse(w.ID); err != nil {
		return bad("event_id %q is not a UUID", truncate(w.ID, 64))
	}
	if err := store.CheckKey(w.AggregateID); err != nil {
		return bad("aggregate_id %s", err)
	}
	if err := store.CheckType(w.Type); err != nil {
		return bad("%s", err)
	}
	if w.ContentType != "" {
		if err := store.CheckContentType(w.ContentType); err != nil {
			return bad("content_type %q %s", truncate(w.ContentType, 64), err)
		}
	}
	if w.Topic != "" {
		if err := store.CheckTopic(w.Topic); err != nil {
			return bad("topic %q %s", truncate(w.Topic, 64), err)
		}
	}
	if w.DeliverAt != nil {
		if err := store.CheckDeliverAt(*w.DeliverAt); err != nil {
			return bad("deliver_at %s", err)
		}
	}
	if err := checkHeaders(w.Headers); err != nil {
		return bad("%s", err)
	}
	hasJSON := len(w.Payload) > 0 && !bytes.Equal(w.Payload, []byte("null"))
	if store.IsJSON(w.ContentType) {
		switch {
		case w.PayloadBase64 != nil:
			return bad("has payload_base64, but content type %q is JSON: the payload goes in payload", m.contentType())
		case !hasJSON:
			return bad("has no payload")
		case !utf8.Valid(w.Payload):
			return bad("payload is not valid UTF-8")
		}
		m.Payload = w.Payload
		return m, nil
	}
	switch {
	case hasJSON:
		return bad("has payload, but content type %q is not JSON: the payload goes in payload_base64", w.ContentType)
	case w.PayloadBase64 == nil:
		return bad("has no payload_base64")
	}
	p, err := base64.StdEncoding.DecodeString(*w.PayloadBase64)
	if err != nil {
		return bad("payload_base64 is not base64: %v", err)
	}
	if p == nil {
		p = []byte{} // an empty payload (Protobuf's default message) is a payload
	}
	m.Payload = p
	return m, nil
}

func (m Message) contentType() string {
	if m.ContentType == "" {
		return "application/json"
	}
	return m.ContentType
}

// checkHeaders refuses the headers outbox.Writer refuses: empty names,
// names the relay sets itself, NUL characters (jsonb cannot hold them),
// and more than store.MaxHeadersBytes as JSON.
func checkHeaders(h map[string]string) error {
	if len(h) == 0 {
		return nil
	}
	for k, v := range h {
		switch {
		case k == "":
			return errors.New("headers have an empty name")
		case slices.Contains(store.ReservedHeaders, k):
			return fmt.Errorf("header name %q is set by the relay", k)
		case strings.ContainsRune(k+v, 0):
			return fmt.Errorf("header %q has a NUL character", truncate(k, 64))
		}
	}
	b, err := json.Marshal(h)
	if err != nil {
		return fmt.Errorf("headers: %w", err)
	}
	if len(b) > store.MaxHeadersBytes {
		return fmt.Errorf("headers are %d bytes as JSON, over the limit of %d", len(b), store.MaxHeadersBytes)
	}
	return nil
}

// MessagePrefix is the logical decoding message prefix of the outbox cfg
// names: "outbox:" then the schema and table, so several outboxes share a
// database and each relay reads only its own.
func MessagePrefix(cfg store.Config) (string, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return "", err
	}
	return "outbox:" + cfg.Schema + "." + cfg.Table, nil
}

func jsonMarshal(v any) ([]byte, error) { return json.Marshal(v) }
