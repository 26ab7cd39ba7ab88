package brokertest_test

import (
	"bytes"
	"encoding/json"
	"strconv"
	"sync"
	"testing"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/brokertest"
	"github.com/outboxhq/outbox/brokers/stdout"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
)

type buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (w *buffer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

// A publisher passes the suite from its own test: Open builds it, Read
// returns what reached the broker. This harness runs the stdout publisher;
// for a real broker, Read consumes from it and Stop cuts a Proxy.
func ExampleRun() {
	_ = func(t *testing.T) {
		var w *buffer
		brokertest.Run(t, brokertest.Harness{
			Open: func(t *testing.T, r *brokers.Routing, _ []string) core.Publisher {
				w = &buffer{}
				return stdout.New(w, r)
			},
			Read: func(t *testing.T, topic string, n int) []brokertest.Received {
				w.mu.Lock()
				defer w.mu.Unlock()
				var got []brokertest.Received
				dec := json.NewDecoder(bytes.NewReader(w.b.Bytes()))
				for dec.More() {
					var l stdout.Line
					if err := dec.Decode(&l); err != nil {
						t.Fatal(err)
					}
					if l.Topic == topic {
						h := map[string]string{event.HeaderEventID: l.ID, event.HeaderEventUID: l.ID, event.HeaderType: l.Type, event.HeaderAggregateID: l.AggregateID,
							event.HeaderEventSeq: strconv.FormatInt(l.Seq, 10)}
						for k, v := range l.Headers {
							h[k] = v
						}
						body := []byte(l.Payload)
						if l.PayloadBase64 != nil {
							body = l.PayloadBase64
						}
						got = append(got, brokertest.Received{Key: l.AggregateID, Headers: h, ContentType: l.ContentType, Body: body})
					}
				}
				if len(got) < n {
					t.Fatalf("topic %s: %d messages, want %d", topic, len(got), n)
				}
				return got[:n]
			},
			JSONBody: true,
		})
	}
}
