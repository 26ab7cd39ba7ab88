package stdout_test

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/outboxhq/outbox/brokers/stdout"
)

// AppendLine writes what encoding/json writes, for any strings, headers
// and payloads.
func FuzzAppendLine(f *testing.F) {
	f.Add(int64(1), "0190-id", "order-1", "order.placed", "orders", "application/json", []byte(`{"a": 1,
 "b": "<x> & \u2028"}`), []byte(nil), "k", "v")
	f.Add(int64(-7), "\x00\x1f\"\\\b\f", "agg\u2029\xff", "t\n\r\t", "", "text/plain", []byte(nil), []byte("bytes\x00\xff"), "<&>", "\xc3\x28")
	f.Add(int64(0), "", "", "", "", "", []byte(`not json`), []byte(nil), "", "")
	f.Fuzz(func(t *testing.T, seq int64, id, agg, typ, topic, ct string, payload, raw []byte, hk, hv string) {
		l := stdout.Line{Seq: seq, ID: id, AggregateID: agg, Type: typ, Topic: topic, ContentType: ct,
			Payload: payload, PayloadBase64: raw}
		if hk != "" {
			l.Headers = map[string]string{hk: hv, "z" + hk: hv + hk}
		}
		want, werr := json.Marshal(l)
		got, gerr := l.AppendLine(nil)
		if (werr != nil) != (gerr != nil) {
			t.Fatalf("encoding/json error %v, AppendLine error %v", werr, gerr)
		}
		if werr == nil && !bytes.Equal(got, want) {
			t.Fatalf("AppendLine\n%s\nencoding/json\n%s", got, want)
		}
	})
}
