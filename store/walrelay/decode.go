package walrelay

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store"
)

var types = pgtype.NewMap()

// decodeRow turns an inserted row into an item. Columns are found by
// name, and read as text, so the decoding does not depend on their types
// (an aggregate_id of type uuid or text) or on columns it does not know.
// skip is true for a row the log relay must not publish: one already
// handed to the table (the relay's own inserts of log-only events), or one
// inserted dispatched or parked.
func decodeRow(rel *pglogrepl.RelationMessage, tuple *pglogrepl.TupleData, commit time.Time, cfg store.Config) (it *item, skip bool) {
	col := map[string]*string{}
	if tuple != nil {
		for i, c := range tuple.Columns {
			if i >= len(rel.Columns) {
				break
			}
			if c.DataType == pglogrepl.TupleDataTypeText || c.DataType == pglogrepl.TupleDataTypeBinary {
				v := string(c.Data)
				col[rel.Columns[i].Name] = &v
			}
		}
	}
	if col["handoff_at"] != nil || col["dispatched_at"] != nil || col["parked_at"] != nil {
		return nil, true
	}
	it = &item{row: true}
	e := &it.ev
	e.CreatedAt = commit
	var bad []string
	str := func(name string) string {
		if v := col[name]; v != nil {
			return *v
		}
		bad = append(bad, name+" is missing")
		return ""
	}
	if seq, err := strconv.ParseInt(str("seq"), 10, 64); err == nil {
		e.Seq = seq
	} else {
		// Without its seq the row cannot be marked or held: nothing to
		// do but leave it pending for the table's operators.
		return nil, true
	}
	e.ID = str("event_id")
	e.AggregateID = str("aggregate_id")
	e.Type = str("type")
	payload := str("payload")
	if v := col["created_at"]; v != nil {
		var t time.Time
		if err := types.Scan(pgtype.TimestamptzOID, pgtype.TextFormatCode, []byte(*v), &t); err == nil {
			e.CreatedAt = t
		}
	}
	if v := col["attempts"]; v != nil {
		e.Attempts, _ = strconv.Atoi(*v)
	}
	headers := col["headers"]
	it.size = int64(len(payload))
	if headers != nil {
		it.size += int64(len(*headers))
	}
	if col["retry_at"] != nil {
		// Inserted to wait (held, or retried later): the table path
		// decides when.
		it.wait = true
		return it, false
	}
	switch {
	case len(bad) > 0:
		it.bad = fmt.Errorf("row %d: %s", e.Seq, strings.Join(bad, ", "))
	case it.size > int64(cfg.MaxEventBytes):
		it.bad = fmt.Errorf("payload and headers are %d bytes, over the relay's limit of %d", it.size, cfg.MaxEventBytes)
	default:
		it.bad = checkEvent(e, headers)
	}
	if it.bad == nil {
		e.Payload = []byte(payload)
	}
	return it, false
}

// checkEvent applies the table relay's checks of what a broker message is
// made of, and decodes the headers.
func checkEvent(e *core.Event, headers *string) error {
	if err := store.CheckType(e.Type); err != nil {
		return err
	}
	if headers == nil || *headers == "null" {
		return nil
	}
	if len(*headers) > store.MaxHeadersBytes {
		return fmt.Errorf("headers are %d bytes, over the limit of %d", len(*headers), store.MaxHeadersBytes)
	}
	if err := json.Unmarshal([]byte(*headers), &e.Headers); err != nil {
		return fmt.Errorf("headers are not a JSON object of strings: %.200s", *headers)
	}
	return nil
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
	msg, err := DecodeMessage(content)
	if err != nil {
		it.bad = err
		return it
	}
	it.ev.ID, it.ev.AggregateID, it.ev.Type, it.ev.Headers = msg.ID, msg.AggregateID, msg.Type, msg.Headers
	switch {
	case !utf8.Valid(msg.Payload):
		it.bad = fmt.Errorf("payload is not valid UTF-8")
	case len(content) > cfg.MaxEventBytes:
		it.bad = fmt.Errorf("event message is %d bytes, over the relay's limit of %d", len(content), cfg.MaxEventBytes)
	default:
		for k := range msg.Headers {
			if k == "" {
				it.bad = fmt.Errorf("headers have an empty name")
			}
		}
	}
	if it.bad == nil {
		it.ev.Payload = msg.Payload
	}
	return it
}
