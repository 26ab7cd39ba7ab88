package stdout_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/brokertest"
	"github.com/outboxhq/outbox/brokers/stdout"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
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
		Read: func(t *testing.T, topic string, n int) []brokertest.Received {
			var got []brokertest.Received
			for _, l := range w.lines(t) {
				if l.Topic != topic {
					continue
				}
				h := map[string]string{
					event.HeaderEventID: l.ID, event.HeaderEventUID: l.ID, event.HeaderEventSeq: jsonNumber(l.Seq),
					event.HeaderType: l.Type, event.HeaderAggregateID: l.AggregateID,
				}
				for k, v := range l.Headers {
					h[k] = v
				}
				body := []byte(l.Payload)
				if l.PayloadBase64 != nil {
					body = l.PayloadBase64
				}
				got = append(got, brokertest.Received{Key: l.AggregateID, Headers: h, ContentType: l.ContentType, Body: body})
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

// countingSink records each write and can hold writes until released.
type countingSink struct {
	mu     sync.Mutex
	buf    bytes.Buffer
	writes int
	hold   chan struct{}
}

func (s *countingSink) Write(p []byte) (int, error) {
	<-s.hold
	time.Sleep(time.Millisecond) // a slow reader, as a pipe can be
	s.mu.Lock()
	defer s.mu.Unlock()
	s.writes++
	return s.buf.Write(p)
}

func (s *countingSink) has(seq int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return bytes.Contains(s.buf.Bytes(), []byte(`{"seq":`+jsonNumber(seq)+`,`))
}

// Publishes at the same time share writes, and none returns before its own
// line is written; a publish whose context ends while it waits returns.
func TestConcurrentPublishesShareWrites(t *testing.T) {
	s := &countingSink{hold: make(chan struct{})}
	p := stdout.New(s, &brokers.Routing{Fixed: "events"})
	const publishers, each = 32, 50
	var wg sync.WaitGroup
	errs := make(chan error, publishers*each)
	for g := range publishers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				seq := int64(g*each + i + 1)
				e := &core.Event{Seq: seq, ID: "id", AggregateID: "a", Type: "t", Payload: []byte(`{}`)}
				if err := p.Publish(context.Background(), e); err != nil {
					errs <- err
					return
				}
				if !s.has(seq) {
					errs <- errors.New("publish returned before its line was written")
					return
				}
			}
		}()
	}
	// Let the writes through only after every publisher is waiting on one.
	time.Sleep(50 * time.Millisecond)
	close(s.hold)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	lines := bytes.Count(s.buf.Bytes(), []byte{'\n'})
	if lines != publishers*each {
		t.Fatalf("%d lines, want %d", lines, publishers*each)
	}
	if s.writes >= lines/2 {
		t.Errorf("%d writes for %d lines: concurrent publishes were not joined", s.writes, lines)
	}
	t.Logf("%d lines in %d writes", lines, s.writes)

	stuck := &countingSink{hold: make(chan struct{})}
	p = stdout.New(stuck, &brokers.Routing{Fixed: "events"})
	go func() { _ = p.Publish(context.Background(), &core.Event{Seq: 1, Payload: []byte(`{}`)}) }()
	time.Sleep(20 * time.Millisecond) // the first publish is inside its write
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := p.Publish(ctx, &core.Event{Seq: 2, Payload: []byte(`{}`)}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("publish behind a stuck write: %v, want the context's deadline", err)
	}
	close(stuck.hold)
}
