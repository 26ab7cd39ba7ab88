// Package stdout is the "stdout" broker: it writes each event as one JSON
// object per line (payloads that are not JSON in base64), for trying the relay and for piping into other tools.
// A publish returns once its line has been written; lines published at the
// same time share one write.
package stdout

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"runtime"
	"sync"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/wm"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
)

func init() {
	brokers.Register("stdout", func(ctx context.Context, p brokers.Options) (core.Publisher, error) {
		var cfg struct{}
		if err := p.Config.Decode(&cfg); err != nil {
			return nil, fmt.Errorf("stdout config: %w", err)
		}
		return New(os.Stdout, p.Topics), nil
	})
}

// Line is the JSON object written for each event.
type Line struct {
	Seq         int64  `json:"seq"`
	ID          string `json:"event_id"`
	AggregateID string `json:"aggregate_id"`
	Type        string `json:"type"`
	Topic       string `json:"topic"`
	ContentType string `json:"content_type"`
	// Payload is a JSON payload as it is; PayloadBase64 holds the bytes
	// of any other content type.
	Payload       json.RawMessage   `json:"payload,omitempty"`
	PayloadBase64 []byte            `json:"payload_base64,omitempty"`
	Headers       map[string]string `json:"headers,omitempty"`
}

// Publisher writes events to an io.Writer.
//
// Concurrent publishes are joined: each appends its line to the pending
// buffer, and whichever holds the write turn lets the publishes ready to
// run append theirs, then writes everything pending in one call, so a
// relay publishing on many lanes makes one system call for many events
// instead of one each. No publish returns before its own line was
// written.
type Publisher struct {
	w      io.Writer
	topics *brokers.Routing
	turn   chan struct{} // holds a token while a write is in progress

	mu      sync.Mutex
	pending []byte // lines waiting for the next write
	spare   []byte // the last write's buffer, reused
	next    *write // the write that will carry pending
}

// write is one call to the writer; done closes once it returned.
type write struct {
	done chan struct{}
	err  error
}

func newWrite() *write { return &write{done: make(chan struct{})} }

var _ core.Publisher = (*Publisher)(nil)

// New returns a publisher writing to w, which it does not close.
func New(w io.Writer, topics *brokers.Routing) *Publisher {
	if topics == nil {
		topics = &brokers.Routing{}
	}
	return &Publisher{w: w, topics: topics, turn: make(chan struct{}, 1), next: newWrite()}
}

// lineBufs holds the buffers lines are encoded into before they join the
// pending write.
var lineBufs = sync.Pool{New: func() any { b := make([]byte, 0, 1024); return &b }}

// Publish implements core.Publisher.
func (p *Publisher) Publish(ctx context.Context, e *core.Event) error {
	topic, err := p.topics.Topic(e)
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	l := Line{Seq: e.Seq, ID: e.ID, AggregateID: e.AggregateID, Type: e.Type,
		Topic: topic, ContentType: wm.ContentType(e), Headers: e.Headers}
	if event.IsJSON(e.ContentType) {
		l.Payload = e.Payload
	} else {
		l.PayloadBase64 = e.Payload
	}
	bp := lineBufs.Get().(*[]byte)
	defer lineBufs.Put(bp)
	b, err := l.AppendLine((*bp)[:0])
	*bp = b
	if err != nil {
		return core.Permanent(fmt.Errorf("encode event %d: %w", e.Seq, err))
	}
	if err := p.writeLine(ctx, b); err != nil {
		return fmt.Errorf("write event %d: %w", e.Seq, err)
	}
	return nil
}

// writeLine queues line and returns once a write that carried it returned.
// A publish whose ctx ends first may still see its line written later:
// the relay then publishes it again, which at-least-once allows.
func (p *Publisher) writeLine(ctx context.Context, line []byte) error {
	p.mu.Lock()
	p.pending = append(append(p.pending, line...), '\n')
	mine := p.next
	p.mu.Unlock()
	for {
		select {
		case <-mine.done:
			return mine.err
		case <-ctx.Done():
			return ctx.Err()
		case p.turn <- struct{}{}:
			// While this turn is held no other write runs, so mine is
			// either written already or is the write made now.
			p.gather()
			p.flush()
			<-p.turn
		}
	}
}

// maxGather bounds the yields of one gather.
const maxGather = 8

// gather lets the publishes that are ready to run append their lines
// before the write: on a busy core they run one after another, and each
// would otherwise make a system call of its own. It yields while the
// pending lines grow, so an idle relay's lone line is written at once.
func (p *Publisher) gather() {
	n := p.pendingLen()
	for range maxGather {
		runtime.Gosched()
		m := p.pendingLen()
		if m == n {
			return
		}
		n = m
	}
}

func (p *Publisher) pendingLen() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.pending)
}

// flush writes what is pending; the caller holds the turn.
func (p *Publisher) flush() {
	p.mu.Lock()
	buf, w := p.pending, p.next
	if len(buf) == 0 {
		p.mu.Unlock()
		return
	}
	p.pending, p.next = p.spare[:0], newWrite()
	p.mu.Unlock()
	_, w.err = p.w.Write(buf)
	close(w.done)
	p.mu.Lock()
	p.spare = buf
	p.mu.Unlock()
}

// Close implements core.Publisher; the writer stays open.
func (p *Publisher) Close() error { return nil }
