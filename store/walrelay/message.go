package walrelay

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/outboxhq/outbox/store"
)

// MessageVersion is the version of the message encoding EncodeMessage
// writes and the relay reads.
const MessageVersion = 1

// Message is one event as a log-only producer emits it.
type Message struct {
	ID          string            // the event's identity (a UUID)
	AggregateID string            // ordering and partition key, as text
	Type        string            // such as "order.placed"
	Headers     map[string]string // may be nil
	Payload     []byte            // JSON, published exactly as given
}

// wireMessage is the encoding of a Message: one JSON object per
// pg_logical_emit_message call, so producers writing SQL can build it with
// json_build_object:
//
//	{"v":1,"event_id":"0190...","aggregate_id":"...","type":"order.placed",
//	 "headers":{"k":"v"},"payload":{...}}
//
// payload is the event's JSON, embedded as is; headers may be absent.
type wireMessage struct {
	V           int               `json:"v"`
	ID          string            `json:"event_id"`
	AggregateID string            `json:"aggregate_id"`
	Type        string            `json:"type"`
	Headers     map[string]string `json:"headers,omitempty"`
	Payload     json.RawMessage   `json:"payload"`
}

// EncodeMessage returns the content of the logical decoding message that
// carries m. The payload goes in byte for byte (encoding/json would
// compact it), so consumers receive what the producer wrote. The caller
// has checked m's fields (outbox.LogWriter does); the payload must be
// valid JSON.
func EncodeMessage(m Message) ([]byte, error) {
	if !json.Valid(m.Payload) {
		return nil, errors.New("encode event message: payload is not valid JSON")
	}
	b := make([]byte, 0, len(m.Payload)+len(m.Type)+128)
	b = append(b, `{"v":1,"event_id":`...)
	b = appendString(b, m.ID)
	b = append(b, `,"aggregate_id":`...)
	b = appendString(b, m.AggregateID)
	b = append(b, `,"type":`...)
	b = appendString(b, m.Type)
	if len(m.Headers) > 0 {
		h, err := json.Marshal(m.Headers)
		if err != nil {
			return nil, fmt.Errorf("encode event message headers: %w", err)
		}
		b = append(b, `,"headers":`...)
		b = append(b, h...)
	}
	b = append(b, `,"payload":`...)
	b = append(b, m.Payload...)
	return append(b, '}'), nil
}

func appendString(b []byte, s string) []byte {
	q, _ := json.Marshal(s) // a string always marshals
	return append(b, q...)
}

// DecodeMessage reads content written by EncodeMessage (or by SQL in the
// same format). The error names what is wrong.
func DecodeMessage(content []byte) (Message, error) {
	var w wireMessage
	if err := json.Unmarshal(content, &w); err != nil {
		return Message{}, fmt.Errorf("event message is not the outbox's JSON object: %w", err)
	}
	switch {
	case w.V != MessageVersion:
		return Message{}, fmt.Errorf("event message version %d is not %d", w.V, MessageVersion)
	case w.ID == "":
		return Message{}, errors.New("event message has no event_id")
	case w.AggregateID == "":
		return Message{}, errors.New("event message has no aggregate_id")
	case len(w.Payload) == 0 || string(w.Payload) == "null":
		return Message{}, errors.New("event message has no payload")
	}
	if err := store.CheckType(w.Type); err != nil {
		return Message{}, fmt.Errorf("event message: %w", err)
	}
	return Message{ID: w.ID, AggregateID: w.AggregateID, Type: w.Type, Headers: w.Headers, Payload: w.Payload}, nil
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
