package brokertest

import (
	"context"
	"hash/fnv"
	"sync"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/memsource"
)

// Settler is an in-memory source with units of ownership (core.Settler),
// for publishers that bind to their source (core.Binder): the
// exactly-once Kafka publisher. Events added with Add are claimed like
// those of any in-memory source, each in the unit of its aggregate, and
// settled once the relay records them; Settle settles events directly.
// An event it does not know is unsettled, as a source that is unsure
// must answer.
type Settler struct {
	*memsource.Source
	name  string
	units int

	mu      sync.Mutex
	added   map[string]int64 // id -> seq
	settled map[string]bool
}

var (
	_ core.Source  = (*Settler)(nil)
	_ core.Settler = (*Settler)(nil)
)

// NewSettler returns an empty source named name with units units.
func NewSettler(name string, units int) *Settler {
	return &Settler{Source: memsource.New(), name: name, units: units, added: map[string]int64{}, settled: map[string]bool{}}
}

// Unit is the unit of an aggregate's events: a hash of its id.
func (s *Settler) Unit(aggregateID string) int {
	h := fnv.New32a()
	_, _ = h.Write([]byte(aggregateID))
	return int(h.Sum32() % uint32(s.units))
}

// Add adds events as committed by a producer, each in its aggregate's
// unit, and returns their seqs.
func (s *Settler) Add(events ...core.Event) []int64 {
	for i := range events {
		events[i].Unit = s.Unit(events[i].AggregateID)
	}
	seqs := s.Source.Add(events...)
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, seq := range seqs {
		s.added[events[i].ID] = seq
	}
	return seqs
}

// Settle records the events as published.
func (s *Settler) Settle(ids ...string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, id := range ids {
		s.settled[id] = true
	}
}

// Units implements core.Settler.
func (s *Settler) Units() (string, int) { return s.name, s.units }

// Unsettled implements core.Settler.
func (s *Settler) Unsettled(_ context.Context, sent []core.Sent) ([]core.Sent, error) {
	pending := map[int64]bool{}
	for _, seq := range s.Pending() {
		pending[seq] = true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []core.Sent
	for _, e := range sent {
		if s.settled[e.ID] {
			continue
		}
		if seq, ok := s.added[e.ID]; ok && !pending[seq] {
			continue // the relay recorded it
		}
		out = append(out, e)
	}
	return out, nil
}
