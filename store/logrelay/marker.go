package logrelay

import (
	"context"
	"errors"
	"sync"
)

// errMarkerStopped answers the rows still waiting when a stream ends: they
// are not recorded, so their events are not confirmed and the next session
// reads them again.
var errMarkerStopped = errors.New("the stream ended before its published rows were marked dispatched")

// marker marks the published rows of every claim of a stream dispatched,
// one write at a time: the rows that finish while a write is in flight go
// together in the next. A stream reading a trickle makes claims of an
// event or two; marked claim by claim, each would be a transaction for the
// server to commit and for its walsender to decode again.
type marker struct {
	write func(ctx context.Context, rows []*item) error

	wake    chan struct{} // a token when rows are queued
	mu      sync.Mutex
	queued  []*item
	waiters []chan error
	stopped bool
}

func newMarker(write func(ctx context.Context, rows []*item) error) *marker {
	return &marker{write: write, wake: make(chan struct{}, 1)}
}

// run writes what is queued until ctx ends; then every waiter still
// waiting hears errMarkerStopped.
func (m *marker) run(ctx context.Context) {
	defer func() {
		m.mu.Lock()
		waiters := m.waiters
		m.queued, m.waiters, m.stopped = nil, nil, true
		m.mu.Unlock()
		for _, w := range waiters {
			w <- errMarkerStopped
		}
	}()
	for {
		select {
		case <-ctx.Done():
			return
		case <-m.wake:
		}
		m.mu.Lock()
		rows, waiters := m.queued, m.waiters
		m.queued, m.waiters = nil, nil
		m.mu.Unlock()
		if len(waiters) == 0 {
			continue
		}
		err := m.write(ctx, rows)
		for _, w := range waiters {
			w <- err
		}
	}
}

// mark queues rows and waits until a write has marked them, or ctx ends.
func (m *marker) mark(ctx context.Context, rows []*item) error {
	if len(rows) == 0 {
		return nil
	}
	done := make(chan error, 1)
	m.mu.Lock()
	if m.stopped {
		m.mu.Unlock()
		return errMarkerStopped
	}
	m.queued = append(m.queued, rows...)
	m.waiters = append(m.waiters, done)
	m.mu.Unlock()
	select {
	case m.wake <- struct{}{}:
	default:
	}
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}
