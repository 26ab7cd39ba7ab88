package table_test

import (
	"context"
	"encoding/json"
	"maps"
	"strings"
	"testing"

	"github.com/google/uuid"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store/table"
)

// FuzzClaimRows writes a row of arbitrary content by SQL between good rows,
// with the table's checks dropped (rows from before them, or a client that
// went around them), and claims until nothing is left. The claim never
// fails; every good row goes out byte for byte; the fuzzed row goes out
// exactly or is held with a reason, and in ordered mode the row behind it
// waits; nothing is lost.
func FuzzClaimRows(f *testing.F) {
	f.Add("order.placed", `{"tenant":"acme"}`, `{"n":1}`, uint16(0), true)
	f.Add("", `{"n":1}`, `[1,2]`, uint16(0), true)
	f.Add("a b", `[1,2]`, `"abc"`, uint16(0), false)
	f.Add("t\x00", `"abc"`, `null`, uint16(0), true)
	f.Add("ok", `null`, `{}`, uint16(600), true)
	f.Add("ok", `{"a":{"b":"c"}}`, `not json`, uint16(0), true)
	f.Add(strings.Repeat("t", 300), ``, `1e999`, uint16(10), false)
	f.Add("é.ü", `{"k":"\u00e9","":""}`, `"\u0000"`, uint16(0), true)

	pool, cfg := pgtest.Schema(f)
	ctx := context.Background()
	dropRowChecks(ctx, f, pool, cfg)
	cfg.MaxEventBytes = 512
	cfg.MaxClaimBytes = 1024
	s, err := table.New(pool, cfg, nil)
	if err != nil {
		f.Fatal(err)
	}
	table := ident(cfg)

	f.Fuzz(func(t *testing.T, typ, headers, payload string, pad uint16, sameAggregate bool) {
		if _, err := pool.Exec(ctx, "DELETE FROM "+table); err != nil {
			t.Fatal(err)
		}
		if !json.Valid([]byte(payload)) {
			b, _ := json.Marshal(payload)
			payload = string(b)
		}
		if pad > 0 {
			payload = `[` + payload + `,"` + strings.Repeat("x", int(pad%2048)) + `"]`
		}
		var h *string
		if headers != "" {
			h = &headers
		}
		// The fuzzed row may share its aggregate with the first good row,
		// which goes before it; the row behind it always shares it.
		a, b := uuid.NewString(), uuid.NewString()
		fuzzAgg := a
		if sameAggregate {
			fuzzAgg = b
		}
		good1, err := insertRaw(ctx, t, pool, table, rawRow{agg: b, typ: "g.one", payload: `{"g":1}`})
		if err != nil {
			t.Fatal(err)
		}
		fuzzed, err := insertRaw(ctx, t, pool, table, rawRow{agg: fuzzAgg, typ: typ, payload: payload, headers: h})
		if err != nil {
			t.Skipf("PostgreSQL refuses the row: %v", err) // not a row a table can hold
		}
		behind, err := insertRaw(ctx, t, pool, table, rawRow{agg: fuzzAgg, typ: "g.behind", payload: `{"g":2}`})
		if err != nil {
			t.Fatal(err)
		}
		good3, err := insertRaw(ctx, t, pool, table, rawRow{agg: uuid.NewString(), typ: "g.three", payload: `{"g":3}`})
		if err != nil {
			t.Fatal(err)
		}

		published := map[int64]core.Event{}
		held := map[int64]string{}
		for round := 0; ; round++ {
			if round > 10 {
				t.Fatal("four rows took more than ten claims")
			}
			c, err := s.Claim(ctx, core.ClaimOptions{Limit: 10})
			if err != nil {
				t.Fatalf("claim failed on a row's content: %v", err)
			}
			rej := c.(core.Rejecter).Rejected()
			if len(c.Events()) == 0 && len(rej) == 0 {
				if err := c.Release(ctx); err != nil {
					t.Fatal(err)
				}
				break
			}
			var done []int64
			for _, e := range c.Events() {
				published[e.Seq] = e
				done = append(done, e.Seq)
			}
			var failed []core.Failure
			for _, r := range rej {
				held[r.Event.Seq] = r.Err.Error()
				failed = append(failed, core.Failure{Seq: r.Event.Seq, Reason: "cannot relay row: " + r.Err.Error()})
			}
			if err := c.Complete(ctx, done, failed); err != nil {
				t.Fatal(err)
			}
		}

		for id, want := range map[int64]string{good1: `{"g":1}`, good3: `{"g":3}`} {
			if e, ok := published[id]; !ok || string(e.Payload) != want {
				t.Fatalf("good row %d: published %v with payload %q", id, ok, e.Payload)
			}
		}
		e, out := published[fuzzed]
		reason, kept := held[fuzzed]
		switch {
		case out == kept:
			t.Fatalf("fuzzed row: published %v, held %v; want exactly one", out, kept)
		case out && string(e.Payload) != payload:
			t.Fatalf("fuzzed row published with payload %q, want %q", e.Payload, payload)
		case out && event.CheckType(e.Type) != nil:
			t.Fatalf("fuzzed row published with type %q: %v", e.Type, event.CheckType(e.Type))
		case out && h != nil:
			var want map[string]string
			if err := json.Unmarshal([]byte(headers), &want); err != nil || !maps.Equal(want, e.Headers) {
				t.Fatalf("fuzzed row published with headers %v from %q (%v)", e.Headers, headers, err)
			}
		case kept && reason == "":
			t.Fatal("fuzzed row held without a reason")
		}
		_, behindOut := published[behind]
		if behindOut != out {
			t.Fatalf("row behind the fuzzed one: published %v, want %v as the fuzzed row", behindOut, out)
		}
		var n int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+table+" WHERE dispatched_at IS NOT NULL OR retry_at = 'infinity' OR seq = $1", behind).Scan(&n); err != nil || n != 4 {
			t.Fatalf("%d of 4 rows accounted for (dispatched, held, or waiting behind): %v", n, err)
		}
	})
}
