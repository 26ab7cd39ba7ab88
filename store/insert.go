package store

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"encoding/hex"
	"fmt"
	"strings"
	"time"
)

// Insert is the producer's statement: any number of rows in one statement
// and one round trip; one row, the common case, as plain VALUES. The
// table's trigger (migration 4) sends the NOTIFY that wakes relays, so the
// statement does not.
type Insert struct {
	pgx, std string // any number of rows, as arrays
	one      string // one row: unnest's arrays cost a lone event more than VALUES
}

// InsertRows are the columns of the rows to insert, one entry per row in
// every slice. Payloads holds JSON payloads and Bytes all others, one of
// the two set per row; ContentTypes, Topics, DeliverAt and Headers are nil
// per row for none (or nil as a whole when no row has one). Headers are
// JSON objects of strings. The caller has checked every value.
type InsertRows struct {
	IDs, AggregateIDs, Types []string
	Payloads                 []*string
	Bytes                    [][]byte
	ContentTypes, Topics     []*string
	DeliverAt                []*time.Time
	Headers                  []*string
}

// NewInsert prepares the insert into the outbox cfg names.
func NewInsert(cfg Config) (*Insert, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return nil, err
	}
	cols := `INSERT INTO ` + cfg.Names().Outbox + ` (event_id, aggregate_id, type, payload, payload_bytes, content_type, topic, deliver_at, headers)`
	head := cols + `
SELECT * FROM unnest(`
	// pgx sends arrays in binary. database/sql drivers differ in what they
	// accept for an array, so that form sends each as the text of an array
	// literal, which every driver passes as a string.
	return &Insert{
		one: cols + `
VALUES ($1::text::uuid, $2::text, $3::text, $4::text::json, $5::bytea, $6::text, $7::text, $8::timestamptz, $9::text::jsonb)`,
		pgx: head + `$1::uuid[], $2::text[], $3::text[], $4::text[]::json[], $5::bytea[], $6::text[], $7::text[], $8::timestamptz[], $9::text[]::jsonb[])`,
		std: head + `$1::text::uuid[], $2::text::text[], $3::text::text[], $4::text::json[], $5::text::bytea[], $6::text::text[],
    $7::text::text[], $8::text::timestamptz[], $9::text::jsonb[])`,
	}, nil
}

// Exec inserts rows with tx, usually the caller's own transaction.
func (i *Insert) Exec(ctx context.Context, tx DBTX, rows InsertRows) error {
	n := len(rows.IDs)
	if n == 1 {
		if _, err := tx.Exec(ctx, i.one, rows.row(0)...); err != nil {
			return fmt.Errorf("insert 1 event: %w", err)
		}
		return nil
	}
	if _, err := tx.Exec(ctx, i.pgx, rows.IDs, rows.AggregateIDs, rows.Types, rows.Payloads, orNil(rows.Bytes, n),
		orNil(rows.ContentTypes, n), orNil(rows.Topics, n), orNil(rows.DeliverAt, n), orNil(rows.Headers, n)); err != nil {
		return fmt.Errorf("insert %d events: %w", n, err)
	}
	return nil
}

// SQLExecer runs a statement through database/sql: a *sql.Tx, *sql.Conn or
// *sql.DB, or a wrapper such as sqlx's.
type SQLExecer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

// ExecSQL inserts rows with a database/sql transaction, in the same single
// statement as Exec. It works with any PostgreSQL driver (pgx's stdlib,
// lib/pq).
func (i *Insert) ExecSQL(ctx context.Context, tx SQLExecer, rows InsertRows) error {
	n := len(rows.IDs)
	if n == 1 {
		args := rows.row(0)
		if t, ok := args[7].(time.Time); ok {
			args[7] = t.Format(time.RFC3339Nano) // as the array form sends it: every driver passes a string
		}
		if _, err := tx.ExecContext(ctx, i.one, args...); err != nil {
			return fmt.Errorf("insert 1 event: %w", err)
		}
		return nil
	}
	strs := func(v []string) arrayLiteral {
		return arrayLiteral{n: n, elem: func(i int) (string, bool) { return v[i], true }}
	}
	ptrs := func(v []*string) arrayLiteral {
		return arrayLiteral{n: n, elem: func(i int) (string, bool) {
			if i >= len(v) || v[i] == nil {
				return "", false
			}
			return *v[i], true
		}}
	}
	bytes := arrayLiteral{n: n, elem: func(i int) (string, bool) {
		if i >= len(rows.Bytes) || rows.Bytes[i] == nil {
			return "", false
		}
		return `\x` + hex.EncodeToString(rows.Bytes[i]), true
	}}
	times := arrayLiteral{n: n, elem: func(i int) (string, bool) {
		if i >= len(rows.DeliverAt) || rows.DeliverAt[i] == nil {
			return "", false
		}
		return rows.DeliverAt[i].Format(time.RFC3339Nano), true
	}}
	if _, err := tx.ExecContext(ctx, i.std, strs(rows.IDs), strs(rows.AggregateIDs), strs(rows.Types), ptrs(rows.Payloads),
		bytes, ptrs(rows.ContentTypes), ptrs(rows.Topics), times, ptrs(rows.Headers)); err != nil {
		return fmt.Errorf("insert %d events: %w", n, err)
	}
	return nil
}

// row returns row i as the arguments of the one-row statement, nil for
// NULL.
func (r InsertRows) row(i int) []any {
	ptr := func(v []*string) any {
		if i >= len(v) || v[i] == nil {
			return nil
		}
		return *v[i]
	}
	var bytes, deliver any
	if i < len(r.Bytes) && r.Bytes[i] != nil {
		bytes = r.Bytes[i]
	}
	if i < len(r.DeliverAt) && r.DeliverAt[i] != nil {
		deliver = *r.DeliverAt[i]
	}
	return []any{r.IDs[i], r.AggregateIDs[i], r.Types[i], ptr(r.Payloads), bytes, ptr(r.ContentTypes), ptr(r.Topics), deliver, ptr(r.Headers)}
}

// orNil gives unnest a column of n NULLs for a slice left nil.
func orNil[T any](v []T, n int) []T {
	if v == nil {
		return make([]T, n)
	}
	return v
}

// arrayLiteral is a PostgreSQL array in its text form, such as
// {"a",NULL,"b\"c"}. Elements are always quoted, so only the quote and the
// backslash need escaping.
type arrayLiteral struct {
	n    int
	elem func(i int) (s string, ok bool)
}

var arrayEscaper = strings.NewReplacer(`\`, `\\`, `"`, `\"`)

// Value implements driver.Valuer.
func (a arrayLiteral) Value() (driver.Value, error) {
	var b strings.Builder
	b.WriteByte('{')
	for i := range a.n {
		if i > 0 {
			b.WriteByte(',')
		}
		s, ok := a.elem(i)
		if !ok {
			b.WriteString("NULL")
			continue
		}
		b.WriteByte('"')
		_, _ = arrayEscaper.WriteString(&b, s)
		b.WriteByte('"')
	}
	b.WriteByte('}')
	return b.String(), nil
}
