// Package outbox writes events into the transactional outbox: inside the
// caller's own transaction, so the event commits or rolls back together
// with the business change it announces. The relay (package core, command
// "outbox relay") later publishes what committed.
//
//	w, _ := outbox.NewWriter(outbox.WriterOptions{})
//	tx, _ := pool.Begin(ctx)
//	// ... business writes on tx ...
//	err := w.Write(ctx, tx, outbox.Message{AggregateID: orderID, Type: "order.placed", Payload: order})
//	// on error, roll back: the business change must not commit without its event
//
// Write takes a pgx transaction; WriteSQL takes a database/sql one (pgx's
// stdlib driver, lib/pq, and what sqlx, GORM, ent or sqlc build on them).
// Producers in other languages call the SQL function the migrations
// install (see docs/producers.md).
package outbox

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel/propagation"

	"github.com/outboxhq/outbox/core/event"
	"github.com/outboxhq/outbox/store"
)

// DBTX is what Write needs from a pgx transaction: pgx.Tx satisfies it, and so
// does anything with the same Exec method (a pgxpool.Tx, a test double).
type DBTX interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

var _ DBTX = (pgx.Tx)(nil)

// Message is one event to write.
type Message struct {
	// AggregateID is the ordering and partition key: any non-empty string
	// of at most event.MaxKeyBytes (255) bytes without control characters,
	// such as a UUID, "ord_2Xb9" or a number as text. Keys are compared
	// byte for byte.
	AggregateID string
	Type        string // such as "order.placed"
	// ContentType is the payload's media type, passed to consumers in the
	// broker's own place for it. Empty means application/json.
	ContentType string
	// Payload, for a JSON content type (application/json or any type
	// ending in +json), is serialized now with encoding/json, so the row
	// holds the exact bytes that will be published; []byte and
	// json.RawMessage are taken as they are and must be valid JSON (a
	// string is serialized as a JSON string). For any other content type (application/x-protobuf,
	// avro/binary, application/octet-stream...) it must be []byte or
	// string, and is published byte for byte.
	Payload any
	Headers map[string]string // optional; names must not be the relay's own
	// Topic, when set, is where the event goes, instead of what the
	// relay's routing rules would pick for its type. The routing's
	// topic prefix still applies.
	Topic string
	// DeliverAt, when set in the future, keeps the event from being
	// published before then. In ordered mode the later events of its
	// aggregate wait behind it; in unordered mode they go ahead.
	DeliverAt time.Time
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
	Index int // position in the Write call
	// Field is "aggregate_id", "type", "content_type", "payload",
	// "headers", "topic", "deliver_at" or "id".
	Field string
	// Msg says what is wrong, naming the field, such as
	// `topic "a b" contains whitespace or a control character`.
	Msg string
}

func (e *ValidationError) Error() string {
	return fmt.Sprintf("outbox: message %d: %s", e.Index, e.Msg)
}

// Write validates msgs, serializes their payloads and inserts them with tx
// in one statement. Nothing is inserted when any message is invalid; the
// error is a *ValidationError. On any error the caller should roll tx back.
func (w *Writer) Write(ctx context.Context, tx DBTX, msgs ...Message) error {
	if len(msgs) == 0 {
		return nil
	}
	rows, err := w.rows(ctx, msgs)
	if err != nil {
		return err
	}
	if err := w.insert.Exec(ctx, tx, rows); err != nil {
		return fmt.Errorf("outbox: %w", err)
	}
	return nil
}

// SQLTx is what WriteSQL needs from a database/sql transaction: *sql.Tx
// satisfies it, and so do *sql.Conn, *sql.DB and sqlx's types.
type SQLTx interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

var _ SQLTx = (*sql.Tx)(nil)

// WriteSQL is Write for a database/sql transaction, with the same
// validation and the same single statement. It works with any PostgreSQL
// driver, such as pgx's stdlib (github.com/jackc/pgx/v5/stdlib) or lib/pq.
func (w *Writer) WriteSQL(ctx context.Context, tx SQLTx, msgs ...Message) error {
	if len(msgs) == 0 {
		return nil
	}
	rows, err := w.rows(ctx, msgs)
	if err != nil {
		return err
	}
	if err := w.insert.ExecSQL(ctx, tx, rows); err != nil {
		return fmt.Errorf("outbox: %w", err)
	}
	return nil
}

// rows validates msgs and lays them out as the insert's columns. Columns
// no message uses stay nil, to be sent as NULLs.
func (w *Writer) rows(ctx context.Context, msgs []Message) (store.InsertRows, error) {
	n := len(msgs)
	r := store.InsertRows{
		IDs: make([]string, n), AggregateIDs: make([]string, n), Types: make([]string, n),
		Payloads: make([]*string, n), Headers: make([]*string, n),
	}
	trace := w.trace(ctx)
	for i, m := range msgs {
		v, err := w.prepare(i, m, trace)
		if err != nil {
			return store.InsertRows{}, err
		}
		r.IDs[i], r.AggregateIDs[i], r.Types[i], r.Headers[i] = v.id, m.AggregateID, m.Type, v.headers
		if v.bytes != nil {
			if r.Bytes == nil {
				r.Bytes = make([][]byte, n)
			}
			r.Bytes[i] = v.bytes
		} else {
			r.Payloads[i] = &v.payload
		}
		if m.ContentType != "" {
			if r.ContentTypes == nil {
				r.ContentTypes = make([]*string, n)
			}
			r.ContentTypes[i] = &msgs[i].ContentType
		}
		if m.Topic != "" {
			if r.Topics == nil {
				r.Topics = make([]*string, n)
			}
			r.Topics[i] = &msgs[i].Topic
		}
		if !m.DeliverAt.IsZero() {
			if r.DeliverAt == nil {
				r.DeliverAt = make([]*time.Time, n)
			}
			r.DeliverAt[i] = &msgs[i].DeliverAt
		}
	}
	return r, nil
}

// trace returns the trace context of ctx as headers, or nil.
func (w *Writer) trace(ctx context.Context) map[string]string {
	if w.opts.Propagator == nil {
		return nil
	}
	carrier := propagation.MapCarrier{}
	w.opts.Propagator.Inject(ctx, carrier)
	if len(carrier) == 0 {
		return nil
	}
	return carrier
}

type prepared struct {
	id, payload string
	bytes       []byte // the payload of a content type that is not JSON
	headers     *string
	headerMap   map[string]string // the same headers, for LogWriter
}

// prepare applies the event rules (package event) to m, serializes its
// payload and adds the trace headers.
func (w *Writer) prepare(i int, m Message, trace map[string]string) (prepared, error) {
	bad := func(field, format string, a ...any) (prepared, error) {
		return prepared{}, &ValidationError{Index: i, Field: field, Msg: field + " " + fmt.Sprintf(format, a...)}
	}
	refused := func(err error) (prepared, error) {
		var fe *event.FieldError
		if errors.As(err, &fe) {
			return prepared{}, &ValidationError{Index: i, Field: fe.Field, Msg: fe.Msg}
		}
		return bad("payload", "%v", err)
	}
	var p prepared
	if err := event.CheckFields(m.AggregateID, m.Type, m.ContentType, m.Topic, m.DeliverAt); err != nil {
		return refused(err)
	}
	if m.ID == "" {
		id, err := uuid.NewV7()
		if err != nil {
			return bad("id", "could not be generated: %v", err)
		}
		p.id = id.String()
	} else {
		id, err := event.ParseID(m.ID)
		if err != nil {
			return bad("id", "%s", err)
		}
		p.id = id
	}
	var raw []byte
	if event.IsJSON(m.ContentType) {
		switch v := m.Payload.(type) {
		case nil:
			return bad("payload", "is nil")
		case []byte:
			raw = v
		case json.RawMessage:
			raw = v
		default:
			var err error
			raw, err = json.Marshal(v)
			if err != nil {
				return bad("payload", "cannot be serialized: %v", err)
			}
		}
	} else {
		switch v := m.Payload.(type) {
		case []byte:
			raw = v
		case string:
			raw = []byte(v)
		default:
			return bad("payload", "is %T; content type %q needs []byte or string", m.Payload, event.Short(m.ContentType))
		}
	}
	if err := event.CheckPayload(m.ContentType, raw, w.opts.MaxPayloadBytes); err != nil {
		return refused(err)
	}
	switch {
	case event.IsJSON(m.ContentType):
		p.payload = string(raw)
	case raw == nil:
		p.bytes = []byte{} // an empty message (Protobuf's default) is a payload, not NULL
	default:
		p.bytes = raw
	}
	if len(m.Headers) > 0 || trace != nil {
		h := make(map[string]string, len(m.Headers)+len(trace))
		for k, v := range m.Headers {
			h[k] = v
		}
		for k, v := range trace {
			h[k] = v
		}
		b, err := event.EncodeHeaders(h)
		if err != nil {
			return refused(err)
		}
		s := string(b)
		p.headers = &s
		p.headerMap = h
	}
	return p, nil
}
