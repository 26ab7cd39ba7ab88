package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"unicode/utf8"

	"github.com/google/uuid"

	"github.com/outboxhq/outbox"
)

// FuzzWriterValidate feeds arbitrary messages to Write. It must never
// panic, must reject with a *ValidationError, and what it accepts must be
// valid JSON within the limit, with a UUID aggregate id.
func FuzzWriterValidate(f *testing.F) {
	f.Add(orderID, "order.placed", []byte(`{"total":42}`), "tenant", "acme")
	f.Add("", "", []byte(nil), "", "")
	f.Add("not-a-uuid", "t", []byte(`{`), "event_uid", "x")
	f.Add(orderID, "t\x00", []byte(`"\ud800"`), "k", "v\x00")
	f.Add("{"+orderID+"}", " ", []byte(" [1, 2 ,3] "), "traceparent", "00-x")
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
		stored := ec.args[3].([]string)[0]
		if len(stored) > limit || !json.Valid([]byte(stored)) || !utf8.ValidString(stored) {
			t.Fatalf("accepted payload %q: %d bytes, valid JSON %v", stored, len(stored), json.Valid([]byte(stored)))
		}
		if stored != string(payload) {
			t.Fatalf("stored payload %q differs from the given %q", stored, payload)
		}
		if _, err := uuid.Parse(ec.args[1].([]string)[0]); err != nil {
			t.Fatalf("accepted aggregate id %q: %v", agg, err)
		}
	})
}
