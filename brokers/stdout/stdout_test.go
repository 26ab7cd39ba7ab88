package stdout_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"sync"
	"testing"

	"go.uber.org/goleak"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/brokertest"
	"github.com/outboxhq/outbox/brokers/stdout"
	"github.com/outboxhq/outbox/core"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// sink is a writer the harness can read back, and break.
type sink struct {
	mu     sync.Mutex
	buf    bytes.Buffer
	broken bool
}

func (s *sink) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.broken {
		return 0, errors.New("broken pipe")
	}
	return s.buf.Write(p)
}

func (s *sink) lines(t *testing.T) []stdout.Line {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []stdout.Line
	sc := bufio.NewScanner(bytes.NewReader(s.buf.Bytes()))
	for sc.Scan() {
		var l stdout.Line
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			t.Fatalf("line %q: %v", sc.Bytes(), err)
		}
		out = append(out, l)
	}
	return out
}

func TestConformance(t *testing.T) {
	var w *sink
	brokertest.Run(t, brokertest.Harness{
		Open: func(t *testing.T, r *brokers.Routing, _ []string) core.Publisher {
			w = &sink{}
			return stdout.New(w, r)
		},
		Read: func(t *testing.T, topic string, n int) []brokertest.Message {
			var got []brokertest.Message
			for _, l := range w.lines(t) {
				if l.Topic != topic {
					continue
				}
				h := map[string]string{
					core.HeaderEventID: l.ID, core.HeaderEventUID: l.ID, core.HeaderEventSeq: jsonNumber(l.Seq),
					core.HeaderType: l.Type, core.HeaderAggregateID: l.AggregateID,
				}
				for k, v := range l.Headers {
					h[k] = v
				}
				body := []byte(l.Payload)
				if l.PayloadBase64 != nil {
					body = l.PayloadBase64
				}
				got = append(got, brokertest.Message{Key: l.AggregateID, Headers: h, ContentType: l.ContentType, Body: body})
			}
			if len(got) < n {
				t.Fatalf("topic %s: %d lines, want %d", topic, len(got), n)
			}
			return got[:n]
		},
		Stop: func(t *testing.T, _ core.Publisher) {
			w.mu.Lock()
			w.broken = true
			w.mu.Unlock()
		},
		// A line holds the payload as a JSON value, so it arrives compacted.
		JSONBody: true,
	})
}

func jsonNumber(id int64) string {
	b, _ := json.Marshal(id)
	return string(b)
}
