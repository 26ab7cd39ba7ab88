package core

import (
	"slices"
	"sync"
	"time"
)

// The relay streams: one claim loop keeps up to Options.Claimers claims
// open, their events wait in the scheduler's queues, Options.Lanes workers
// publish them, and each claim is recorded, in its own transaction, as soon
// as the last of its events is resolved. No claim waits for another: the
// next batch is claimed while the last is published and the one before it
// is recorded.
//
// In ordered mode each aggregate has its own queue and at most one of its
// events is published at a time, in claim order. The source's gate keeps an
// aggregate's events in claims of one relay at a time; within the relay,
// the claim loop tells the source which events it has in flight (InFlight of
// ClaimOptions), so a newer claim may take the next events of an aggregate
// whose earlier ones are still queued here: they are queued behind them.

// state is what became of one claimed event.
type state uint8

const (
	stQueued     state = iota // waiting for a lane
	stPublishing              // a lane is publishing it
	stPublished               // the broker has it; recorded when its claim is
	stFailed                  // the publish failed; recorded as a failure
	stLeft                    // not attempted, or cancelled: stays pending
	stHandedOff               // handed off by the claim (HandOffer); failed if its err is set
)

// batch is one open claim and the fate of each of its events.
type batch struct {
	seq       uint64 // claims are numbered in the order they were made
	opened    time.Time
	claim     Claim
	handOffer HandOffer // set when claim is one: its events are handed off, never left
	events    []Event
	rejected  []Rejection
	states    []state
	errs      []error // the publish error of each failed event
	remaining int     // events not yet resolved
}

// item is one event of a batch waiting in a queue.
type item struct {
	b *batch
	i int
}

// queue holds one aggregate's waiting events (ordered mode), or every
// waiting event (unordered mode).
type queue struct {
	key     string
	items   []item // FIFO; head at items[0]
	busy    bool   // ordered: one of its events is being published
	busyB   *batch // the batch of that event
	since   time.Time
	inReady bool
}

// scheduler is what the relay's lanes publish from: the queues of claimed
// events, the ready list the lanes take from, and the set of open batches.
// A lane is one publishing worker (Options.Lanes).
type scheduler struct {
	ordered bool

	mu      sync.Mutex
	cond    *sync.Cond // a queue became ready, or the scheduler closed
	queues  map[string]*queue
	all     *queue   // unordered: the one queue
	ready   []*queue // queues with an event to publish and no busy lane
	waiting int      // events queued, not yet taken by a lane
	open    map[*batch]bool
	closed  bool
	// claimSeq is the number of the claim made last (or being made).
	claimSeq uint64
	// cutFrom holds, per aggregate, a claim number: events of that
	// aggregate from earlier claims are left pending when they arrive.
	// It is set when an aggregate's publish fails or stalls while a claim
	// that counted its events in flight may still be running.
	cutFrom map[string]uint64
	// stalled aggregates are not offered as in flight to new claims until
	// their slow publish returns, so their later events are not claimed
	// only to be let go again.
	stalled map[string]bool
	// An aggregate with aggCap events queued or more is held back from
	// new claims (capped) until half of them are published, and its
	// events past aggCap (excess in all) do not count against the room
	// for new claims: one hot or stalled aggregate never fills the window
	// the others' events are claimed into.
	aggCap int
	excess int
	capped map[string]bool
	// wake makes the relay claim now: an aggregate it held back may take
	// new events again.
	wake func()
	// drop is called with batches that the scheduler resolved completely.
	drop func(*batch)
	// roomBelow: kick is signalled when waiting falls below it.
	roomBelow int
	kick      chan struct{}
	// spare holds emptied queues for reuse: most aggregates have one
	// event in flight, so a queue would otherwise be made for each event.
	spare []*queue
}

// maxSpare bounds the emptied queues kept for reuse.
const maxSpare = 1024

func newScheduler(ordered bool, roomBelow int, drop func(*batch), wake func()) *scheduler {
	s := &scheduler{
		ordered: ordered, queues: map[string]*queue{}, open: map[*batch]bool{},
		cutFrom: map[string]uint64{}, stalled: map[string]bool{},
		aggCap: max(1, roomBelow/4), capped: map[string]bool{}, wake: wake,
		drop: drop, roomBelow: roomBelow, kick: make(chan struct{}, 1),
		all: &queue{},
	}
	s.cond = sync.NewCond(&s.mu)
	return s
}

func (s *scheduler) signal() {
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// startClaim numbers the claim about to be made and returns the events in
// flight that it may count as its own for the gate: those queued, being
// published or published, except for the aggregates it holds back, which
// it returns: stalled ones and those with aggCap events queued. Failed and
// let-go events are left out, so the gate holds their aggregates back.
func (s *scheduler) startClaim() (seq uint64, inFlight []int64, heldBack []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.claimSeq++
	if !s.ordered {
		return s.claimSeq, nil, nil
	}
	for key := range s.stalled {
		heldBack = append(heldBack, key)
	}
	for key, q := range s.queues {
		if len(q.items) >= s.aggCap && !s.stalled[key] {
			s.capped[key] = true
			heldBack = append(heldBack, key)
		}
	}
	for b := range s.open {
		for i := range b.events {
			switch b.states[i] {
			case stQueued, stPublishing, stPublished:
				key := b.events[i].AggregateID
				if !s.stalled[key] && !s.capped[key] {
					inFlight = append(inFlight, b.events[i].Seq)
				}
			}
		}
	}
	return s.claimSeq, inFlight, heldBack
}

// add queues a claimed batch. Its rejected rows are resolved as failures
// by the caller. It returns false when the batch needs no lane at all.
func (s *scheduler) add(b *batch) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.open[b] = true
	for i := range b.events {
		q := s.all
		if s.ordered {
			key := b.events[i].AggregateID
			if from, ok := s.cutFrom[key]; ok && b.seq < from {
				b.states[i] = stLeft
				b.remaining--
				continue
			}
			if q = s.queues[key]; q == nil {
				if n := len(s.spare); n > 0 {
					q, s.spare = s.spare[n-1], s.spare[:n-1]
					q.key = key
				} else {
					q = &queue{key: key}
				}
				s.queues[key] = q
			}
		}
		q.items = append(q.items, item{b, i})
		s.waiting++
		if s.ordered && len(q.items) > s.aggCap {
			s.excess++
		}
		if !q.busy && !q.inReady {
			q.inReady = true
			s.ready = append(s.ready, q)
			s.cond.Signal()
		} else if !s.ordered {
			// Unordered: every event can go to a lane of its own.
			s.cond.Signal()
		}
	}
	// Entries no claim still running can be affected by are spent.
	for key, from := range s.cutFrom {
		if from <= b.seq+1 {
			delete(s.cutFrom, key)
		}
	}
	// One lane woken per queue made ready (per event unordered): a
	// broadcast would wake every idle lane to find one event.
	return b.remaining > 0
}

// take blocks until an event is ready to publish and marks it publishing;
// false means the scheduler is closed.
func (s *scheduler) take() (item, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for len(s.ready) == 0 && !s.closed {
		s.cond.Wait()
	}
	if len(s.ready) == 0 {
		return item{}, false
	}
	q := s.ready[0]
	s.ready[0] = nil
	s.ready = s.ready[1:]
	it := q.items[0]
	if s.ordered && len(q.items) > s.aggCap {
		s.excess--
	}
	q.items[0] = item{}
	q.items = q.items[1:]
	s.waiting--
	if s.waiting-s.excess == s.roomBelow-1 {
		s.signal()
	}
	it.b.states[it.i] = stPublishing
	if s.ordered {
		q.busy, q.busyB, q.since, q.inReady = true, it.b, time.Now(), false
		s.uncap(q)
	} else if len(q.items) > 0 {
		// Unordered: other lanes take the next events at once.
		s.ready = append(s.ready, q)
	} else {
		q.inReady = false
	}
	return it, true
}

// finish records the outcome st of a publish; err is the failure
// recorded with it, if any. In ordered mode an event failed or left lets
// its aggregate's queued events go, so none passes it; a handed-off one
// does not: the claim hands the aggregate's next events off after it.
func (s *scheduler) finish(it item, st state, err error) {
	var resolved []*batch
	s.mu.Lock()
	b := it.b
	b.states[it.i] = st
	b.errs[it.i] = err
	if done := s.resolve(b); done {
		resolved = append(resolved, b)
	}
	if s.ordered {
		key := b.events[it.i].AggregateID
		q := s.queues[key]
		q.busy, q.busyB = false, nil
		if s.stalled[key] {
			delete(s.stalled, key)
			s.wake() // its later events may be claimed now
		}
		if st == stFailed || st == stLeft {
			resolved = append(resolved, s.letGo(q, 0)...)
			s.cutFrom[key] = s.claimSeq + 1
		}
		if len(q.items) > 0 {
			q.inReady = true
			s.ready = append(s.ready, q)
			s.cond.Signal()
		} else {
			// Neither busy nor ready: nothing else refers to it.
			s.uncap(q)
			delete(s.queues, key)
			if len(s.spare) < maxSpare {
				*q = queue{items: q.items[:0]}
				s.spare = append(s.spare, q)
			}
		}
	}
	s.mu.Unlock()
	for _, b := range resolved {
		s.drop(b)
	}
}

// resolve counts one event of b as resolved; true when it was the last.
// Callers hold mu.
func (s *scheduler) resolve(b *batch) bool {
	b.remaining--
	return b.remaining == 0
}

// uncap ends holding q's aggregate back for its queue's length once half
// of it is published, and wakes the relay to claim its next events.
// Callers hold mu.
func (s *scheduler) uncap(q *queue) {
	if s.capped[q.key] && len(q.items) <= s.aggCap/2 {
		delete(s.capped, q.key)
		s.wake()
	}
}

// letGo leaves pending every queued event of q from position from on, and
// returns the batches this resolved completely. Callers hold mu.
func (s *scheduler) letGo(q *queue, from int) []*batch {
	if q != s.all {
		s.excess -= max(0, len(q.items)-max(from, s.aggCap))
	}
	var resolved []*batch
	for _, it := range q.items[from:] {
		it.b.states[it.i] = stLeft
		s.waiting--
		if s.resolve(it.b) {
			resolved = append(resolved, it.b)
		}
	}
	clear(q.items[from:])
	q.items = q.items[:from]
	if s.waiting-s.excess < s.roomBelow {
		s.signal()
	}
	return resolved
}

// relieve lets go the queued events that hold a batch open only because an
// earlier event of their aggregate, from an older batch, has been
// publishing for longer than after: that batch can then be recorded, and
// the aggregate takes no new events until the slow publish returns. The
// relay calls it when every claim it may open is open.
func (s *scheduler) relieve(after time.Duration) {
	if !s.ordered {
		return // no event waits for another
	}
	var resolved []*batch
	s.mu.Lock()
	now := time.Now()
	for key, q := range s.queues {
		// A claim that hands off cannot leave an event pending: its
		// stalled aggregate's events wait, and claiming goes on (handsOff).
		if !q.busy || now.Sub(q.since) < after || q.busyB.handOffer != nil {
			continue
		}
		for i, it := range q.items {
			if it.b != q.busyB {
				resolved = append(resolved, s.letGo(q, i)...)
				s.stalled[key] = true
				s.cutFrom[key] = s.claimSeq + 1
				break
			}
		}
	}
	s.mu.Unlock()
	for _, b := range resolved {
		s.drop(b)
	}
}

// letGoAll leaves every queued event pending, as a stop does: what is
// being published finishes, the rest is for the next relay.
func (s *scheduler) letGoAll() {
	var resolved []*batch
	s.mu.Lock()
	for key, q := range s.queues {
		if len(q.items) > 0 && q.items[0].b.handOffer != nil {
			// Its events cannot be left pending: they are published or
			// handed off, until a hard stop cuts the lanes short.
			continue
		}
		resolved = append(resolved, s.letGo(q, 0)...)
		if !q.busy {
			delete(s.queues, key)
		}
	}
	if len(s.all.items) == 0 || s.all.items[0].b.handOffer == nil {
		resolved = append(resolved, s.letGo(s.all, 0)...)
	}
	s.ready = slices.DeleteFunc(s.ready, func(q *queue) bool {
		if len(q.items) == 0 {
			q.inReady = false
			return true
		}
		return false
	})
	s.mu.Unlock()
	for _, b := range resolved {
		s.drop(b)
	}
}

// closeBatch forgets a batch once its claim has ended.
func (s *scheduler) closeBatch(b *batch) {
	s.mu.Lock()
	delete(s.open, b)
	s.mu.Unlock()
}

// openOver reports whether a batch has been open for longer than d.
func (s *scheduler) openOver(d time.Duration) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for b := range s.open {
		if time.Since(b.opened) > d {
			return true
		}
	}
	return false
}

// queuedCount is how many events wait for a lane, counting at most
// aggCap of one aggregate.
func (s *scheduler) queuedCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.waiting - s.excess
}

// close stops the workers once they are idle.
func (s *scheduler) close() {
	s.mu.Lock()
	s.closed = true
	s.cond.Broadcast()
	s.mu.Unlock()
}
