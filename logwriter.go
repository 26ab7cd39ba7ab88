package outbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/outboxhq/outbox/core/event"
)

// LogWriter writes events into PostgreSQL's write-ahead log only, with
// pg_logical_emit_message in the caller's transaction, through the
// outbox's log write function (migration 9), which refuses the write while
// no slot of the database would read it (create the slot first): no table row, no
// index entry, nothing to clean up. The event commits or rolls back with
// the transaction, and the log relay (relay.mode log) reads it from its
// replication slot in commit order. The server needs wal_level=logical.
//
// Messages are checked as Writer checks them, and carry the same fields
// (any key, a content type with bytes payloads, a topic, a deliver-at
// time); the encoding is event.EncodeLogMessage's. A scheduled event is
// handed by the relay to the table when it reads it, and published from
// there when due. LogWriter is safe for concurrent use.
type LogWriter struct {
	w   *Writer
	sql string
}

// NewLogWriter checks opts. opts.Store names the outbox whose log relay
// reads the events (the message prefix is event.MessagePrefix of its schema and table).
func NewLogWriter(opts WriterOptions) (*LogWriter, error) {
	w, err := NewWriter(opts)
	if err != nil {
		return nil, fmt.Errorf("new log writer: %w", err)
	}
	fn, err := w.opts.Store.LogWriteFunc()
	if err != nil {
		return nil, fmt.Errorf("new log writer: %w", err)
	}
	// One message per element, in order, in one statement. The function
	// (migration 9) refuses the write while no slot would read it.
	return &LogWriter{w: w, sql: `SELECT ` + fn + `(m) FROM unnest($1::text[]) AS m`}, nil
}

// Write validates msgs and emits them with tx. Nothing is emitted when any
// message is invalid; the error is a *ValidationError. On any error the
// caller should roll tx back.
func (l *LogWriter) Write(ctx context.Context, tx DBTX, msgs ...Message) error {
	if len(msgs) == 0 {
		return nil
	}
	trace := l.w.trace(ctx)
	contents := make([]string, len(msgs))
	for i, m := range msgs {
		p, err := l.w.prepare(i, m, trace)
		if err != nil {
			return err
		}
		payload := p.bytes
		if payload == nil {
			payload = []byte(p.payload)
		}
		b, err := event.EncodeLogMessage(event.LogMessage{
			ID: p.id, AggregateID: m.AggregateID, Type: m.Type, ContentType: m.ContentType, Topic: m.Topic,
			DeliverAt: m.DeliverAt, Headers: p.headerMap, Payload: payload,
		})
		if err != nil {
			var fe *event.FieldError
			if errors.As(err, &fe) {
				return &ValidationError{Index: i, Field: fe.Field, Msg: fe.Msg}
			}
			return &ValidationError{Index: i, Field: "payload", Msg: "payload " + err.Error()}
		}
		contents[i] = string(b)
	}
	if _, err := tx.Exec(ctx, l.sql, contents); err != nil {
		return fmt.Errorf("outbox: emit %d events: %w", len(msgs), err)
	}
	return nil
}
