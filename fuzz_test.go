package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"unicode/utf8"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/core/event"
)

// FuzzWriterValidate feeds arbitrary messages to Write. It must never
// panic, must reject with a *ValidationError, and what it accepts must be
// valid JSON within the limit, with the aggregate key as given and one
// the table accepts.
func FuzzWriterValidate(f *testing.F) {
	f.Add(orderID, "order.placed", []byte(`{"total":42}`), "tenant", "acme")
	f.Add("", "", []byte(nil), "", "")
	f.Add("not-a-uuid", "t", []byte(`{`), "event_uid", "x")
	f.Add(orderID, "t\x00", []byte(`"\ud800"`), "k", "v\x00")
	f.Add("{"+orderID+"}", " ", []byte(" [1, 2 ,3] "), "traceparent", "00-x")
	// Inputs the fuzzer once found interesting, kept as seeds here rather
	// than as a corpus folder at the top of the module.
	f.Add(string("00"), string(""), []byte(""), string(""), string(""))
	f.Add(string("00000000000000000000000000000000"), string("0"), []byte("0"), string("ޣƊ"), string("0"))
	f.Add(string("00000000-0000-0000-0000-000000000000"), string("0"), []byte("00"), string("0"), string("0"))
	f.Add(string("0000000000000000"), string("0"), []byte("0"), string("0"), string("0"))
	f.Add(string("\"\"\"\"\"\"\"\""), string("0"), []byte("0"), string("0"), string("0"))
	f.Add(string("00000000-0000-0000-0000-000000000000"), string("0   "), []byte("0"), string("0"), string("0"))
	f.Add(string("\n\n\n\n\n\n\n\n"), string("0"), []byte("0"), string("0"), string("0"))
	f.Add(string("ŗѣѮ"), string("0"), []byte("0"), string("0"), string("0"))
	f.Add(string("\xb9大ع"), string("0"), []byte("0"), string("0"), string(""))
	f.Add(string("\x7f\x7f"), string("0"), []byte("0"), string("0"), string("0"))
	f.Add(string("00000000-0000-0000-0000-000000000000"), string("0"), []byte("\""), string("0"), string("0"))
	f.Add(string("00000000-0000-0000-0000-000000000000"), string("0000000000000000000"), []byte("{\"000\":10}"), string("00&&&&&&&&00"), string("0000"))
	f.Add(string("0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0d"), string("order.placed"), []byte("\"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\""), string(""), string(""))
	f.Add(string("0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0d"), string("order.placed"), []byte("\"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\""), string(""), string(""))
	f.Add(string("0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0d"), string("order.placed"), []byte("{}"), string("aggregate_id"), string("x"))
	f.Add(string("urn:uuid:0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0d"), string("order.placed"), []byte("{}"), string("tenant"), string("acme"))
	f.Add(string("0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0d"), string("order.placed"), []byte(" \n{ \"b\" : 1 , \"a\" : 2 }\t"), string(""), string(""))
	const limit = 256
	w, err := outbox.NewWriter(outbox.WriterOptions{MaxPayloadBytes: limit})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, agg, typ string, payload []byte, hk, hv string) {
		msg := outbox.Message{AggregateID: agg, Type: typ, Payload: payload}
		if hk != "" || hv != "" {
			msg.Headers = map[string]string{hk: hv}
		}
		ec := &execCounter{}
		err := w.Write(context.Background(), ec, msg)
		if err != nil {
			var verr *outbox.ValidationError
			if !errors.As(err, &verr) {
				t.Fatalf("rejected with %T %v, want a *ValidationError", err, err)
			}
			if ec.calls != 0 {
				t.Fatal("a rejected message reached the database")
			}
			return
		}
		if ec.calls != 1 {
			t.Fatalf("%d statements for an accepted message", ec.calls)
		}
		// One message goes as the one-row statement's arguments.
		stored := ec.args[3].(string)
		if len(stored) > limit || !json.Valid([]byte(stored)) || !utf8.ValidString(stored) {
			t.Fatalf("accepted payload %q: %d bytes, valid JSON %v", stored, len(stored), json.Valid([]byte(stored)))
		}
		if stored != string(payload) {
			t.Fatalf("stored payload %q differs from the given %q", stored, payload)
		}
		if key := ec.args[1].(string); event.CheckKey(key) != nil || key != agg {
			t.Fatalf("accepted aggregate id %q stored as %q", agg, key)
		}
	})
}
