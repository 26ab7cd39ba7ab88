package store

import (
	"errors"
	"strings"
	"time"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
)

// Row is one outbox row as a source reads it, before the event rules are
// applied: the table source scans its claims into one, and the log source
// fills one from a decoded insert.
type Row struct {
	Seq                   int64
	ID, AggregateID, Type string
	// One of the two payload columns is set (the table checks it): JSON
	// in payload, any other content type's bytes in payload_bytes.
	Payload, PayloadBytes []byte
	ContentType, Topic    *string
	Headers               *string // the headers' JSON as stored
	CreatedAt             time.Time
	Attempts              int
	Replays               int   // times an operator replayed it (migration 14)
	Size                  int64 // payload and headers in bytes, as stored
}

// Event checks what the table could not: the parts of the row a broker
// message is made of (event.CheckRow, with the relay's limit
// maxEventBytes). A JSON payload is in a JSON column, so PostgreSQL has
// already checked it; other payloads are bytes to pass on as they are.
// On an error the event is returned too, without its payload, for the
// relay to hold it.
func (r *Row) Event(maxEventBytes int) (core.Event, error) {
	e := core.Event{Seq: r.Seq, ID: r.ID, AggregateID: r.AggregateID, Type: r.Type,
		Payload: r.Payload, CreatedAt: r.CreatedAt, Attempts: r.Attempts, Replays: r.Replays}
	if e.Payload == nil {
		e.Payload = r.PayloadBytes
	}
	if r.ContentType != nil {
		e.ContentType = *r.ContentType
	}
	if r.Topic != nil {
		e.Topic = *r.Topic
	}
	h, err := event.CheckRow(e.Type, r.Headers, r.Size, maxEventBytes)
	e.Headers = h
	if err == nil && e.Payload == nil {
		// The row grew past the limit between the two checks: impossible
		// in one statement, but never publish an empty payload.
		err = errors.New("payload was not read")
	}
	if err != nil {
		e.Payload = nil
		return e, err
	}
	return e, nil
}

// MaxReason bounds a stored failure reason, in bytes.
const MaxReason = 2000

// Reason makes a failure's reason storable (see AsText) and cuts it to
// MaxReason bytes.
func Reason(s string) string { return event.Truncate(AsText(s), MaxReason) }

// AsText makes s storable as text: an error message can carry any bytes
// (a broker's reply, a payload quoted back), and PostgreSQL refuses
// invalid UTF-8 and NUL in text, which would fail the whole outcome's
// record, and the batch's next attempt the same way, for good.
func AsText(s string) string {
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}
