package logrelay

import (
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/outboxhq/outbox/core/event"
	"github.com/outboxhq/outbox/store"
)

// decodeRow turns an inserted row into an item. Columns are found by
// name, and read as text, so the decoding does not depend on their types
// (an aggregate_id of type uuid or text) or on columns it does not know.
// skip is true for a row the log relay must not publish: one already
// handed to the table (the relay's own inserts of log-only events), or one
// inserted dispatched or parked.
func decodeRow(rel *pglogrepl.RelationMessage, tuple *pglogrepl.TupleData, commit time.Time, cfg store.Config) (it *item, skip bool) {
	col := columns(rel, tuple)
	if col["handoff_at"] != nil || col["dispatched_at"] != nil || col["parked_at"] != nil {
		return nil, true
	}
	row, bad, ok := rowFromText(col, commit)
	if !ok {
		// Without its seq the row cannot be marked or held: nothing to
		// do but leave it pending for the table's operators.
		return nil, true
	}
	deliverAt, wait := waits(col, row.Attempts)
	// The table source's check of a claimed row.
	ev, err := row.Event(cfg.MaxEventBytes)
	it = &item{ev: ev, row: true, size: row.Size}
	switch {
	case wait:
		// The table path's, which checks it when it claims it.
		it.wait = true
	case len(bad) > 0:
		it.ev.Payload, it.ev.Headers = nil, nil
		it.bad = fmt.Errorf("row %d: %s", row.Seq, strings.Join(bad, ", "))
		it.deliverAt = deliverAt
	default:
		it.bad = err
		it.deliverAt = deliverAt
	}
	return it, false
}

// columns maps the names of rel's columns to tuple's values, as text;
// a NULL or unchanged value is absent.
func columns(rel *pglogrepl.RelationMessage, tuple *pglogrepl.TupleData) map[string]*string {
	col := map[string]*string{}
	if tuple == nil {
		return col
	}
	for i, c := range tuple.Columns {
		if i >= len(rel.Columns) {
			break
		}
		if c.DataType == pglogrepl.TupleDataTypeText || c.DataType == pglogrepl.TupleDataTypeBinary {
			v := string(c.Data)
			col[rel.Columns[i].Name] = &v
		}
	}
	return col
}

// rowFromText reads a row's columns, as the stream sends them, into a
// store.Row (its CreatedAt the commit time unless created_at is
// readable); bad lists what is missing or unreadable. ok is false when
// the seq is.
func rowFromText(col map[string]*string, commit time.Time) (row store.Row, bad []string, ok bool) {
	str := func(name string) string {
		if v := col[name]; v != nil {
			return *v
		}
		bad = append(bad, name+" is missing")
		return ""
	}
	seq, err := strconv.ParseInt(str("seq"), 10, 64)
	if err != nil {
		return row, nil, false
	}
	row = store.Row{Seq: seq, ID: str("event_id"), AggregateID: str("aggregate_id"), Type: str("type"),
		ContentType: col["content_type"], Topic: col["topic"], Headers: col["headers"], CreatedAt: commit}
	// One of the two payload columns is set (the table checks it): JSON
	// in payload, any other content type's bytes in payload_bytes.
	if v := col["payload"]; v != nil {
		row.Payload = []byte(*v)
	} else if v := col["payload_bytes"]; v != nil {
		// Hex, as the session asks (bytea_output); an empty payload is
		// a payload, not nil.
		b, ok := strings.CutPrefix(*v, `\x`)
		row.PayloadBytes = make([]byte, hex.DecodedLen(len(b)))
		if _, err := hex.Decode(row.PayloadBytes, []byte(b)); !ok || err != nil {
			bad = append(bad, "payload_bytes is not in bytea's hex format")
		}
	} else {
		bad = append(bad, "payload and payload_bytes are missing")
	}
	if v := col["created_at"]; v != nil {
		if t, ok := timestamp(*v); ok {
			row.CreatedAt = t
		}
	}
	if v := col["attempts"]; v != nil {
		row.Attempts, _ = strconv.Atoi(*v)
	}
	if v := col["replays"]; v != nil {
		row.Replays, _ = strconv.Atoi(*v)
	}
	row.Size = int64(len(row.Payload) + len(row.PayloadBytes))
	if row.Headers != nil {
		row.Size += int64(len(*row.Headers))
	}
	return row, bad, true
}

// waits applies the timing rules to a row: deliverAt is when a scheduled
// one is due; wait says it is the table path's, inserted to wait.
func waits(col map[string]*string, attempts int) (deliverAt time.Time, wait bool) {
	if v := col["deliver_at"]; v != nil {
		t, ok := timestamp(*v)
		if !ok {
			// Never publish a scheduled event early: the table path
			// reads the column itself.
			return time.Time{}, true
		}
		deliverAt = t
	}
	if v := col["retry_at"]; v != nil {
		// A scheduled row (migration 7's trigger copies deliver_at into
		// retry_at) is the log relay's to publish once due; any other
		// row inserted to wait (held, or retried later) the table path's.
		if t, ok := timestamp(*v); !ok || deliverAt.IsZero() || !t.Equal(deliverAt) || attempts > 0 {
			return time.Time{}, true
		}
	}
	return deliverAt, false
}

// timestamp reads a timestamptz column as the stream sends it (text).
func timestamp(v string) (time.Time, bool) {
	var t pgtype.Timestamptz
	if err := t.Scan(v); err != nil || t.InfinityModifier != pgtype.Finite {
		return time.Time{}, false
	}
	return t.Time, true
}

// decodeMessage turns a logical decoding message of the outbox's prefix
// into an item. Its seq is the message's WAL position: unique, though not
// an order across transactions.
func decodeMessage(m *pglogrepl.LogicalDecodingMessage, commit time.Time, cfg store.Config) *item {
	// The message's bytes live in the connection's buffer: copy them.
	content := append([]byte(nil), m.Content...)
	it := &item{raw: content, size: int64(len(content))}
	it.ev.Seq = int64(m.LSN)
	it.ev.CreatedAt = commit
	msg, err := event.DecodeLogMessage(content)
	it.ev.ID, it.ev.AggregateID, it.ev.Type, it.ev.Headers = msg.ID, msg.AggregateID, msg.Type, msg.Headers
	it.ev.ContentType, it.ev.Topic, it.deliverAt = msg.ContentType, msg.Topic, msg.DeliverAt
	switch {
	case err != nil:
		it.bad = err
	case len(content) > cfg.MaxEventBytes:
		it.bad = fmt.Errorf("event message is %d bytes, over the relay's limit of %d", len(content), cfg.MaxEventBytes)
	default:
		it.ev.Payload = msg.Payload
	}
	return it
}
