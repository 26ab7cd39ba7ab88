// Package outbox writes events into the transactional outbox: inside the
// caller's own pgx transaction, so the event commits or rolls back together
// with the business change it announces. The relay (package core, command
// "outbox relay") later publishes what committed.
//
//	w, _ := outbox.NewWriter(outbox.WriterOptions{})
//	tx, _ := pool.Begin(ctx)
//	// ... business writes on tx ...
//	err := w.Write(ctx, tx, outbox.Message{AggregateID: orderID, Type: "order.placed", Payload: order})
//	// on error, roll back: the business change must not commit without its event
package outbox

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel/propagation"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store"
)

// DBTX is what Write needs from a transaction: pgx.Tx satisfies it, and so
// does anything with the same Exec method (a pgxpool.Tx, a test double).
type DBTX interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

var _ DBTX = (pgx.Tx)(nil)

// Message is one event to write.
type Message struct {
	AggregateID string // a UUID; the ordering and partition key
	Type        string // such as "order.placed"
	// Payload is serialized now with encoding/json, so the row holds the
	// exact bytes that will be published. []byte and json.RawMessage are
	// taken as they are and must be valid JSON.
	Payload any
	Headers map[string]string // optional; names must not be the relay's own
	// ID is the event's identity across outboxes; a UUIDv7 is generated
	// when empty. Set it to make a retried write idempotent downstream.
	ID string
}

// WriterOptions configure a Writer. The zero value is valid.
type WriterOptions struct {
	Store store.Config // schema and table names; defaults as in store.Config
	// MaxPayloadBytes rejects larger payloads; default
	// DefaultMaxPayloadBytes. Brokers have
	// their own limits (Kafka's default is 1 MB per message).
	MaxPayloadBytes int
	// Propagator, when set, stores the trace context of ctx (W3C
	// traceparent with the usual propagator) in the event's headers.
	Propagator propagation.TextMapPropagator
}

// DefaultMaxPayloadBytes is the Writer's payload limit when
// WriterOptions.MaxPayloadBytes is unset.
const DefaultMaxPayloadBytes = 1 << 20

// Writer writes events. It is safe for concurrent use.
type Writer struct {
	opts   WriterOptions
	insert *store.Insert
}

// NewWriter checks opts and prepares the insert statement.
func NewWriter(opts WriterOptions) (*Writer, error) {
	cfg, err := opts.Store.WithDefaults()
	if err != nil {
		return nil, fmt.Errorf("new writer: %w", err)
	}
	opts.Store = cfg
	if opts.MaxPayloadBytes < 0 {
		return nil, fmt.Errorf("new writer: MaxPayloadBytes %d is negative", opts.MaxPayloadBytes)
	}
	if opts.MaxPayloadBytes == 0 {
		opts.MaxPayloadBytes = DefaultMaxPayloadBytes
	}
	ins, err := store.NewInsert(cfg)
	if err != nil {
		return nil, fmt.Errorf("new writer: %w", err)
	}
	return &Writer{opts: opts, insert: ins}, nil
}

// ValidationError says which message of a Write was rejected and why.
type ValidationError struct {
	Index int    // position in the Write call
	Field string // "aggregate_id", "type", "payload", "headers" or "id"
	Msg   string
}

func (e *ValidationError) Error() string {
	return fmt.Sprintf("outbox: message %d: %s %s", e.Index, e.Field, e.Msg)
}

// Write validates msgs, serializes their payloads and inserts them with tx.
// Nothing is inserted when any message is invalid; the error is a
// *ValidationError. On any error the caller should roll tx back.
func (w *Writer) Write(ctx context.Context, tx DBTX, msgs ...Message) error {
	if len(msgs) == 0 {
		return nil
	}
	n := len(msgs)
	ids, aggs, types, payloads := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	headers := make([]*string, n)
	var trace map[string]string
	if w.opts.Propagator != nil {
		carrier := propagation.MapCarrier{}
		w.opts.Propagator.Inject(ctx, carrier)
		if len(carrier) > 0 {
			trace = carrier
		}
	}
	for i, m := range msgs {
		v, err := w.prepare(i, m, trace)
		if err != nil {
			return err
		}
		ids[i], aggs[i], types[i], payloads[i], headers[i] = v.id, v.agg, m.Type, v.payload, v.headers
	}
	rows := store.InsertRows{IDs: ids, AggregateIDs: aggs, Types: types, Payloads: payloads, Headers: headers}
	if err := w.insert.Exec(ctx, tx, rows); err != nil {
		return fmt.Errorf("outbox: %w", err)
	}
	return nil
}

type prepared struct {
	id, agg, payload string
	headers          *string
}

var reservedHeaders = map[string]bool{
	core.HeaderEventID: true, core.HeaderEventSeq: true, core.HeaderEventUID: true, core.HeaderType: true, core.HeaderAggregateID: true,
}

func (w *Writer) prepare(i int, m Message, trace map[string]string) (prepared, error) {
	bad := func(field, format string, a ...any) (prepared, error) {
		return prepared{}, &ValidationError{Index: i, Field: field, Msg: fmt.Sprintf(format, a...)}
	}
	var p prepared
	if m.AggregateID == "" {
		return bad("aggregate_id", "is empty")
	}
	agg, err := uuid.Parse(m.AggregateID)
	if err != nil {
		return bad("aggregate_id", "%q is not a UUID", truncateForError(m.AggregateID))
	}
	p.agg = agg.String()
	if m.ID == "" {
		id, err := uuid.NewV7()
		if err != nil {
			return bad("id", "could not be generated: %v", err)
		}
		p.id = id.String()
	} else {
		id, err := uuid.Parse(m.ID)
		if err != nil {
			return bad("id", "%q is not a UUID", truncateForError(m.ID))
		}
		p.id = id.String()
	}
	if err := store.CheckType(m.Type); err != nil {
		return bad("type", "%s", strings.TrimPrefix(err.Error(), "type "))
	}
	var raw []byte
	switch v := m.Payload.(type) {
	case nil:
		return bad("payload", "is nil")
	case []byte:
		raw = v
	case json.RawMessage:
		raw = v
	default:
		raw, err = json.Marshal(v)
		if err != nil {
			return bad("payload", "cannot be serialized: %v", err)
		}
	}
	switch {
	case len(raw) > w.opts.MaxPayloadBytes:
		return bad("payload", "is %d bytes, over the limit of %d", len(raw), w.opts.MaxPayloadBytes)
	case !json.Valid(raw):
		return bad("payload", "is not valid JSON")
	case !utf8.Valid(raw):
		return bad("payload", "is not valid UTF-8")
	}
	p.payload = string(raw)
	if len(m.Headers) > 0 || trace != nil {
		h := make(map[string]string, len(m.Headers)+len(trace))
		for k, v := range m.Headers {
			switch {
			case k == "":
				return bad("headers", "has an empty name")
			case reservedHeaders[k]:
				return bad("headers", "name %q is set by the relay", k)
			case !utf8.ValidString(k) || !utf8.ValidString(v) || strings.ContainsRune(k+v, 0):
				return bad("headers", "%q has invalid characters", truncateForError(k))
			}
			h[k] = v
		}
		for k, v := range trace {
			h[k] = v
		}
		b, err := json.Marshal(h)
		if err != nil {
			return bad("headers", "cannot be serialized: %v", err)
		}
		if len(b) > store.MaxHeadersBytes {
			return bad("headers", "are %d bytes as JSON, over the limit of %d", len(b), store.MaxHeadersBytes)
		}
		s := string(b)
		p.headers = &s
	}
	return p, nil
}

func truncateForError(s string) string {
	if len(s) > 64 {
		s = s[:64] + "..."
	}
	return strings.ToValidUTF8(s, "?")
}
