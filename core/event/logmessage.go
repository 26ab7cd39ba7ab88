package event

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"math"
	"time"
)

// LogMessageVersion is the version of the encoding EncodeLogMessage
// writes and the log relay reads.
const LogMessageVersion = 1

// MessagePrefix is the logical decoding message prefix of the outbox
// table schema.table: "outbox:" then the names, so several outboxes share
// a database and each relay reads only its own.
func MessagePrefix(schema, table string) string {
	return "outbox:" + schema + "." + table
}

// LogMessage is one event as a log-only producer emits it: the fields of a
// row of the outbox table (see docs/producers.md for the table contract).
type LogMessage struct {
	ID          string // the event's identity (a UUID)
	AggregateID string // ordering and partition key, as CheckKey accepts
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
	// (IsJSON), any bytes for another.
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

// EncodeLogMessage returns the content of the logical decoding message that
// carries m. A JSON payload goes in byte for byte (encoding/json would
// compact it), so consumers receive what the producer wrote; only
// whitespace around the JSON value is not kept. The caller has checked
// m's fields (outbox.LogWriter does, as outbox.Writer checks rows);
// EncodeLogMessage refuses, with a *FieldError, only what its format cannot
// carry: a JSON content type with a payload that is not JSON, or a
// DeliverAt outside the years 0 to 9999 of RFC 3339.
func EncodeLogMessage(m LogMessage) ([]byte, error) {
	jsonPayload := IsJSON(m.ContentType)
	if jsonPayload && !json.Valid(m.Payload) {
		return nil, fmt.Errorf("encode event message: %w", fieldError("payload", "is not valid JSON"))
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
			return nil, fmt.Errorf("encode event message: %w",
				fieldError("deliver_at", "%s is outside the years 0 to 9999 of RFC 3339", m.DeliverAt.UTC().Format(time.DateTime)))
		}
		b = append(b, `,"deliver_at":`...)
		b = append(b, t...)
	}
	if len(m.Headers) > 0 {
		h, err := json.Marshal(m.Headers)
		if err != nil {
			return nil, fmt.Errorf("encode event message: %w", fieldError("headers", "cannot be serialized: %v", err))
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

// DecodeLogMessage reads content written by EncodeMessage (or by SQL in the
// same format) and checks it as the writers check an event: the error
// names the field at fault. When the error comes after the JSON object
// was read, the returned Message holds the fields as read, so the caller
// can still name the event; its Payload is nil.
func DecodeLogMessage(content []byte) (LogMessage, error) {
	var w wireMessage
	if err := json.Unmarshal(content, &w); err != nil {
		return LogMessage{}, fmt.Errorf("event message is not the outbox's JSON object: %w", err)
	}
	m := LogMessage{ID: w.ID, AggregateID: w.AggregateID, Type: w.Type, ContentType: w.ContentType, Topic: w.Topic, Headers: w.Headers}
	if w.DeliverAt != nil {
		m.DeliverAt = *w.DeliverAt
	}
	bad := func(format string, a ...any) (LogMessage, error) {
		return m, fmt.Errorf("event message: "+format, a...)
	}
	if w.V != LogMessageVersion {
		return bad("version %d is not %d", w.V, LogMessageVersion)
	}
	if w.ID == "" {
		return bad("has no event_id")
	}
	if _, err := ParseID(w.ID); err != nil {
		return bad("event_id %s", err)
	}
	if err := CheckFields(m.AggregateID, m.Type, m.ContentType, m.Topic, m.DeliverAt); err != nil {
		return bad("%w", err)
	}
	if _, err := EncodeHeaders(w.Headers); err != nil {
		return bad("%w", err)
	}
	hasJSON := len(w.Payload) > 0 && !bytes.Equal(w.Payload, []byte("null"))
	var p []byte
	if IsJSON(w.ContentType) {
		switch {
		case w.PayloadBase64 != nil:
			return bad("has payload_base64, but content type %q is JSON: the payload goes in payload", m.contentType())
		case !hasJSON:
			return bad("has no payload")
		}
		p = w.Payload
	} else {
		switch {
		case hasJSON:
			return bad("has payload, but content type %q is not JSON: the payload goes in payload_base64", w.ContentType)
		case w.PayloadBase64 == nil:
			return bad("has no payload_base64")
		}
		var err error
		if p, err = base64.StdEncoding.DecodeString(*w.PayloadBase64); err != nil {
			return bad("payload_base64 is not base64: %v", err)
		}
		if p == nil {
			p = []byte{} // an empty payload (Protobuf's default message) is a payload
		}
	}
	// The relay bounds the whole message instead (its event limit).
	if err := CheckPayload(w.ContentType, p, math.MaxInt); err != nil {
		return bad("%w", err)
	}
	m.Payload = p
	return m, nil
}

func (m LogMessage) contentType() string {
	if m.ContentType == "" {
		return "application/json"
	}
	return m.ContentType
}
