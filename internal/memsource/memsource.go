// Package memsource is an in-memory core.Source with the same claiming
// rules as the table source: disjoint claims, seq order, the per-aggregate
// gate in ordered mode (with the caller's events in flight) and retry
// times. It is for tests of the relay engine and of code built on it; it
// keeps nothing across restarts.
package memsource

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/outboxhq/outbox/core"
)

// Source holds events in memory. The zero value is not usable; call New.
type Source struct {
	mu      sync.Mutex
	nextSeq int64
	rows    map[int64]*row
	claimed map[int64]bool
	// claimErr, when set, is returned by Claim (see SetClaimErr).
	claimErr error
}

var (
	_ core.Source  = (*Source)(nil)
	_ core.Settler = (*Source)(nil)
)

type row struct {
	ev         core.Event
	dispatched bool
	retryAt    *time.Time // nil: available; zero time: held until retried
	lastError  string
}

// New returns an empty source.
func New() *Source {
	return &Source{rows: make(map[int64]*row), claimed: make(map[int64]bool)}
}

// Add appends events as if committed by a producer, assigning seqs, and ids
// when unset, and returns the seqs.
func (s *Source) Add(events ...core.Event) []int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	seqs := make([]int64, 0, len(events))
	for _, e := range events {
		s.nextSeq++
		e.Seq = s.nextSeq
		if e.ID == "" {
			e.ID = uuid.NewString()
		}
		if e.CreatedAt.IsZero() {
			e.CreatedAt = time.Now()
		}
		s.rows[e.Seq] = &row{ev: e}
		seqs = append(seqs, e.Seq)
	}
	return seqs
}

// Pending returns the seqs of events not yet dispatched, in seq order.
func (s *Source) Pending() []int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	var seqs []int64
	for seq, r := range s.rows {
		if !r.dispatched {
			seqs = append(seqs, seq)
		}
	}
	slices.Sort(seqs)
	return seqs
}

// LastError returns the recorded failure reason of an event.
func (s *Source) LastError(seq int64) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r := s.rows[seq]; r != nil {
		return r.lastError
	}
	return ""
}

// Held reports whether an event is held until an operator retries it.
func (s *Source) Held(seq int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.rows[seq]
	return r != nil && r.retryAt != nil && r.retryAt.IsZero()
}

// Retry makes a held or backing-off event available now.
func (s *Source) Retry(seq int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r := s.rows[seq]; r != nil {
		r.retryAt = nil
	}
}

// SetClaimErr makes Claim fail with err until called with nil; tests use it
// to simulate an unreachable database. It is safe to call while relays run.
func (s *Source) SetClaimErr(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.claimErr = err
}

// Claim implements core.Source.
func (s *Source) Claim(ctx context.Context, req core.ClaimOptions) (core.Claim, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.claimErr != nil {
		return nil, s.claimErr
	}
	// Events the caller has in flight count as its own for the gate while
	// they are in an open claim; one whose claim has ended since the caller
	// listed it is pending like any other, or dispatched.
	inFlight := make(map[int64]bool, len(req.InFlight))
	for _, seq := range req.InFlight {
		inFlight[seq] = s.claimed[seq]
	}
	now := time.Now()
	seqs := make([]int64, 0, len(s.rows))
	for seq, r := range s.rows {
		if !r.dispatched {
			seqs = append(seqs, seq)
		}
	}
	slices.Sort(seqs)
	// blocked holds aggregates whose earliest pending event is not ours.
	blocked := make(map[string]bool)
	c := &claim{s: s}
	for _, seq := range seqs {
		if len(c.events) >= req.Limit {
			break
		}
		r := s.rows[seq]
		agg := r.ev.AggregateID
		available := !s.claimed[seq] && (r.retryAt == nil || (!r.retryAt.IsZero() && !r.retryAt.After(now)))
		if !req.Unordered && blocked[agg] {
			continue
		}
		if inFlight[seq] {
			continue
		}
		if !available {
			blocked[agg] = true
			continue
		}
		s.claimed[seq] = true
		// A copy, so a publisher touching it cannot change the stored row.
		e := r.ev
		e.Payload = slices.Clone(e.Payload)
		e.Headers = maps.Clone(e.Headers)
		c.events = append(c.events, e)
	}
	return c, nil
}

type claim struct {
	s      *Source
	events []core.Event
	ended  bool
}

var _ core.Claim = (*claim)(nil)

func (c *claim) Events() []core.Event { return c.events }

func (c *claim) Complete(ctx context.Context, done []int64, failed []core.Failure) error {
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	// Only this claim's events may be recorded, as they are the only ones
	// it holds.
	mine := make(map[int64]bool, len(c.events))
	for _, e := range c.events {
		mine[e.Seq] = true
	}
	for _, seq := range done {
		if !mine[seq] {
			return fmt.Errorf("complete claim: event %d is not in this claim", seq)
		}
	}
	for _, f := range failed {
		if !mine[f.Seq] {
			return fmt.Errorf("complete claim: failed event %d is not in this claim", f.Seq)
		}
	}
	if err := c.end(); err != nil {
		return err
	}
	for _, seq := range done {
		c.s.rows[seq].dispatched = true
	}
	for _, f := range failed {
		r := c.s.rows[f.Seq]
		r.ev.Attempts++
		r.lastError = f.Reason
		t := f.RetryAt
		r.retryAt = &t
	}
	return nil
}

func (c *claim) Release(ctx context.Context) error {
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	return c.end()
}

func (c *claim) end() error {
	if c.ended {
		return errors.New("claim already ended")
	}
	c.ended = true
	for _, e := range c.events {
		delete(c.s.claimed, e.Seq)
	}
	return nil
}

// Units implements core.Settler: one unit, every event's 0.
func (s *Source) Units() (name string, n int) { return "memsource", 1 }

// Unsettled implements core.Settler: those of sent whose event, the same
// seq, id and replays, is not dispatched.
func (s *Source) Unsettled(_ context.Context, sent []core.Sent) ([]core.Sent, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []core.Sent
	for _, e := range sent {
		if r := s.rows[e.Seq]; r != nil && r.ev.ID == e.ID && r.ev.Replays == e.Replays && !r.dispatched {
			out = append(out, e)
		}
	}
	return out, nil
}
