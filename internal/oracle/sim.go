package oracle

import (
	"fmt"
	"sort"
	"strings"
	"time"
)

// Promise names one promise the record is checked against.
type Promise string

const (
	// Every committed event is delivered at least once.
	PromiseDelivery Promise = "delivery"
	// A log-only write while the log relay's slot does not exist yet fails
	// in the producer's transaction, which then rolls back (nothing of it
	// is delivered); with the slot in place no write is refused.
	PromiseRefusedBeforeSlot Promise = "refused-before-slot"
	// A held, scheduled or parked event holds back only the later events of
	// its aggregate: the earlier ones are delivered.
	PromiseOnlyLaterBlocked Promise = "only-later-blocked"
	// A replayed event is delivered again.
	PromiseReplay Promise = "replay"
	// Nothing is delivered that did not commit (rolled back, never written).
	PromiseNoPhantom Promise = "no-phantom"
	// An event is never delivered while it is held, parked or behind a
	// held, scheduled or parked event of its aggregate (ordered modes).
	PromiseBlocked Promise = "blocked"
	// A scheduled event is not delivered before its deliver-at time.
	PromiseNotBeforeDue Promise = "not-before-due"
	// First deliveries of an aggregate follow commit order.
	PromiseOrder Promise = "order"
	// The same, for events that went through the table path of log mode.
	PromiseOrderHandoff Promise = "order-after-handoff"
	// No event is delivered twice, but by an operator's replay (a new
	// delivery by intent): checked only on the exactly-once path.
	PromiseNoDuplicate Promise = "no-duplicate"
)

// Violation is one broken promise.
type Violation struct {
	Promise Promise
	Detail  string
}

func (v Violation) String() string { return string(v.Promise) + ": " + v.Detail }

// Written is what the database says of one event after its transaction
// ended.
type Written struct {
	ID        string
	Committed bool
	CommitPos int   // position in the database's commit order (a logical decoding slot); -1 if none
	Seq       int64 // the row's seq; 0 for a log-only event
	// Tx numbers the event's transaction in the history: the events of
	// one transaction share it.
	Tx int
	// BeforeSlot: in a log mode, written while the relay's slot did not exist.
	BeforeSlot bool
	// Refused: the transaction failed because the log write function
	// refused a log-only write in it (SQLSTATE 55000: no slot reads it).
	Refused   bool
	DeliverAt time.Time // zero when not scheduled
}

// Delivery is one publish the broker took. Counter numbers publishes in
// the order the broker took them, from 1.
type Delivery struct {
	N       int // the event's label; -1 when the event is not one the history wrote
	ID      string
	Counter int
	At      time.Time
	// Via says, where the broker tells, what made the delivery (on Kafka:
	// the partition and offset, the producer's transactional id and
	// epoch): for reading a violation.
	Via string
}

type status int

const (
	unwritten status = iota
	mustNot          // pending and never delivered: must not have been delivered
	must             // must have been delivered (again, after a replay) by now
	done             // delivered before; redeliveries are duplicates
	loose            // nothing is promised at this point
)

type simEvent struct {
	spec        EventSpec
	w           Written
	handedOff   bool
	dispatched  bool
	parked      bool
	everParked  bool
	retried     bool
	replayAfter int // a delivery after this counter is owed; 0 if none
	replays     int // replays that made it pending again
	everDone    bool
	points      []point // at each settle point
}

// point is what the model says of an event at one settle point.
type point struct {
	st    status
	after int // for must: the delivery must come after this counter (a replay's)
}

// stopper says whether a pending event holds back its aggregate for the
// rest of the run.
func (e *simEvent) stopper() bool {
	return e.spec.Sched == Far || e.spec.Fault == Bad || (e.spec.Fault == Permanent && !e.retried)
}

// Sim is the reference model: fed the history's steps as they run and
// what the database says of each write, it says at each settle point which
// events must have been delivered, and at the end checks the broker's
// record.
type Sim struct {
	mode   Mode
	events map[int]*simEvent
	order  []int // labels in write order
	marks  []int // the delivery counter at each settle point
	held   []int // at the last settle point, the events the relay must have recorded held
	// once: every delivery beyond the first of an event, not owed to a
	// replay, breaks PromiseNoDuplicate.
	once bool
}

// NewSim returns a model of mode with nothing written.
func NewSim(mode Mode) *Sim { return &Sim{mode: mode, events: map[int]*simEvent{}} }

// ExactlyOnce makes the model forbid duplicates: an event is delivered
// once, and once more for each replay.
func (s *Sim) ExactlyOnce() { s.once = true }

// Wrote records an event's write.
func (s *Sim) Wrote(spec EventSpec, w Written) {
	e := &simEvent{spec: spec, w: w}
	for range s.marks {
		e.points = append(e.points, point{st: unwritten})
	}
	s.events[spec.N] = e
	s.order = append(s.order, spec.N)
}

// HandedOff records that the event went through the table path of log mode.
func (s *Sim) HandedOff(n int) {
	if e := s.events[n]; e != nil {
		e.handedOff = true
	}
}

// Operate applies an operator action taken at delivery counter mark,
// after a settle point. Operators act on rows: row says whether the
// event had one (a log-only event has one only once the log relay handed
// it to the table); without one the action does nothing.
func (s *Sim) Operate(st Step, mark int, row bool) {
	e := s.events[st.Target]
	if e == nil || !e.w.Committed || !row && st.Kind != Retry {
		return
	}
	switch st.Kind {
	case Retry:
		e.retried = true
	case Park:
		if !e.dispatched && !e.parked {
			e.parked, e.everParked = true, true
		}
	case Unpark:
		e.parked = false
	case Replay:
		if e.dispatched && e.spec.Producer.Row() {
			e.dispatched = false
			e.replayAfter = mark
		}
	}
}

// Replayed records that an operator's replay made event n pending again
// (whether or not the model knew it dispatched: a relay stopped since
// may have published it): one more delivery of it is no duplicate.
func (s *Sim) Replayed(n int) {
	if e := s.events[n]; e != nil {
		e.replays++
	}
}

// keyed returns the committed events of each aggregate in the order the
// relay must take them: commit order in log modes, seq order in table
// modes (the claims' order; with locked producers it is commit order).
// Rows committed before a log relay's slot existed are the exception: no
// slot saw their commits, so they are handed to the table at its creation
// and keep seq order among themselves, ahead of everything after.
func (s *Sim) keyed() map[int][]*simEvent {
	out := map[int][]*simEvent{}
	for _, n := range s.order {
		e := s.events[n]
		if e.w.Committed {
			out[e.spec.Key] = append(out[e.spec.Key], e)
		}
	}
	for _, es := range out {
		sort.SliceStable(es, func(i, j int) bool { return s.before(es[i], es[j]) })
	}
	return out
}

func (s *Sim) before(a, b *simEvent) bool {
	if s.mode.Log() && !(a.w.BeforeSlot && b.w.BeforeSlot) {
		return a.w.CommitPos < b.w.CommitPos
	}
	return a.w.Seq < b.w.Seq
}

// promised says whether a's first delivery must come before b's, given
// that a comes before b in keyed order. In table mode that holds only for
// pairs whose seq order is also their commit order (producers that lock
// their aggregate always give such pairs).
func (s *Sim) promised(a, b *simEvent) bool {
	if s.mode.Log() {
		return true
	}
	return a.w.CommitPos <= b.w.CommitPos
}

// Settle computes what the relay must have delivered once it has had
// time to deliver everything it can, and returns the labels of the events
// owed a delivery (with the counter it must come after). Seal closes the
// settle point once the driver has waited for them. With the relay
// stopped (running false) nothing is owed: what it may have delivered
// before it stopped is left open, and owed at the next settle point with
// a relay.
func (s *Sim) Settle(running bool) map[int]int {
	owed := map[int]int{}
	s.held = nil
	st := map[*simEvent]point{}
	for _, es := range s.keyed() {
		blocked := false
		for _, e := range es {
			var p point
			switch {
			case e.parked:
				p.st = mustNot
			case e.dispatched:
				p.st = done
			case blocked:
				p.st = mustNot
			case e.stopper():
				p.st = mustNot
				blocked = s.mode.Ordered()
				if running && e.spec.Fault != None {
					s.held = append(s.held, e.spec.N)
				}
			case !running:
				p.st = loose
			default:
				p = point{st: must, after: e.replayAfter}
				owed[e.spec.N] = e.replayAfter
				e.dispatched = true
				e.replayAfter = 0
			}
			if p.st == mustNot && e.everDone {
				p.st = loose // a redelivery of a replayed event is a duplicate
			}
			st[e] = p
		}
	}
	for _, n := range s.order {
		e := s.events[n]
		p, ok := st[e]
		if !ok {
			p.st = mustNot // rolled back: never to be delivered
		}
		e.points = append(e.points, p)
	}
	s.marks = append(s.marks, -1)
	return owed
}

// Held returns the events the relay, running, must have tried and recorded
// held (a permanent failure not retried since, a bad row) by the last
// settle point: the first such event of its aggregate in ordered modes,
// every one in unordered mode. The driver waits for them as it waits for
// the deliveries owed, so that an operator action meets them held, as an
// operator who looked first would.
func (s *Sim) Held() []int { return s.held }

// Seal sets the delivery counter of the last settle point.
func (s *Sim) Seal(mark int) {
	s.marks[len(s.marks)-1] = mark
	for _, e := range s.events {
		if e.points[len(e.points)-1].st == must {
			e.everDone = true
		}
	}
}

// Check checks the broker's record against the model at every settle
// point. The history must end with a settle point.
func (s *Sim) Check(record []Delivery) []Violation {
	var out []Violation
	add := func(p Promise, format string, args ...any) {
		out = append(out, Violation{p, fmt.Sprintf(format, args...)})
	}
	byN := map[int][]Delivery{}
	for _, d := range record {
		e := s.events[d.N]
		if e == nil || !e.w.Committed {
			add(PromiseNoPhantom, "event %s (#%d) was delivered but never committed", d.ID, d.N)
			continue
		}
		byN[d.N] = append(byN[d.N], d)
	}
	out = append(out, s.checkRefusals()...)
	keyed := s.keyed()
	for _, n := range s.order {
		e := s.events[n]
		if !e.w.Committed {
			continue
		}
		ds := byN[n]
		prev := unwritten
		for k, p := range e.points {
			from, to := 0, s.marks[k]
			if k > 0 {
				from = s.marks[k-1]
			}
			switch p.st {
			case must:
				if !deliveredIn(ds, p.after, to) {
					add(s.missing(e, k, keyed), "%s was not delivered by settle point %d", e.spec, k+1)
				}
			case mustNot:
				if prev == unwritten || prev == mustNot {
					if d, ok := firstIn(ds, from, to); ok {
						add(s.blockedBy(e, k, keyed), "%s was delivered (publish %d) while it was held, parked or behind such an event", e.spec, d.Counter)
					}
				}
			}
			prev = p.st
		}
		if s.once && len(ds) > 1+e.replays {
			var pubs []string
			for _, d := range ds {
				p := fmt.Sprint(d.Counter)
				if d.Via != "" {
					p += " " + d.Via
				}
				pubs = append(pubs, p)
			}
			handedOff := ""
			if e.handedOff && s.mode.Log() {
				handedOff = ", handed off to the table"
			}
			add(PromiseNoDuplicate, "%s was delivered %d times (publishes %s), replayed %d times%s", e.spec, len(ds), strings.Join(pubs, "; "), e.replays, handedOff)
		}
		if !e.w.DeliverAt.IsZero() {
			for _, d := range ds {
				if d.At.Before(e.w.DeliverAt.Add(-50 * time.Millisecond)) {
					add(PromiseNotBeforeDue, "%s was delivered %s before its deliver-at time", e.spec, e.w.DeliverAt.Sub(d.At).Round(time.Millisecond))
					break
				}
			}
		}
	}
	if s.mode.Ordered() {
		out = append(out, s.checkOrder(keyed, byN)...)
	}
	return out
}

// mustBeRefused says whether the event's write must fail: a log-only
// event written while no slot existed.
func (e *simEvent) mustBeRefused() bool { return e.w.BeforeSlot && !e.spec.Producer.Row() }

// checkRefusals checks that exactly the transactions with a log-only
// write before the slot existed failed, refused by the log write
// function.
func (s *Sim) checkRefusals() []Violation {
	type txn struct {
		events        []*simEvent
		refused, must bool
	}
	var txs []*txn
	byTx := map[int]*txn{}
	for _, n := range s.order {
		e := s.events[n]
		t := byTx[e.w.Tx]
		if t == nil {
			t = &txn{}
			byTx[e.w.Tx] = t
			txs = append(txs, t)
		}
		t.events = append(t.events, e)
		t.refused = t.refused || e.w.Refused
		t.must = t.must || e.mustBeRefused()
	}
	var out []Violation
	for _, t := range txs {
		names := make([]string, len(t.events))
		for i, e := range t.events {
			names[i] = e.spec.String()
		}
		what := "tx {" + strings.Join(names, "; ") + "}"
		switch {
		case t.must && !t.refused:
			out = append(out, Violation{PromiseRefusedBeforeSlot, what + " wrote a log-only event before the slot existed, and the write was not refused"})
		case t.refused && !t.must:
			out = append(out, Violation{PromiseRefusedBeforeSlot, what + " was refused, though it wrote no log-only event before the slot existed"})
		}
	}
	return out
}

// blockedBy names the promise an event delivered while the model holds it
// back breaks: when a log-only event written before the slot holds it
// back, that event was lost because its write was not refused, which is
// the promise broken.
func (s *Sim) blockedBy(e *simEvent, k int, keyed map[int][]*simEvent) Promise {
	for _, o := range keyed[e.spec.Key] {
		if o == e {
			break
		}
		if o.mustBeRefused() && o.points[k].st == mustNot {
			return PromiseRefusedBeforeSlot
		}
	}
	return PromiseBlocked
}

// missing names the promise an undelivered event breaks.
func (s *Sim) missing(e *simEvent, k int, keyed map[int][]*simEvent) Promise {
	if e.mustBeRefused() {
		return PromiseRefusedBeforeSlot // committed, when its write was to fail
	}
	// On the exactly-once path the publisher itself decides whether an
	// event is in the broker already, so a replay owed and missing is put
	// down to the replay first.
	if s.once && e.points[k].after > 0 {
		return PromiseReplay
	}
	// Checked before a replay's promise: a replayed event held back by a
	// later one breaks this promise first.
	if s.mode.Ordered() {
		later := false
		for _, o := range keyed[e.spec.Key] {
			if o == e {
				later = true
				continue
			}
			if later && o.points[k].st == mustNot && (o.stopper() || o.everParked) {
				return PromiseOnlyLaterBlocked
			}
		}
	}
	if e.points[k].after > 0 {
		return PromiseReplay
	}
	return PromiseDelivery
}

// checkOrder checks that first deliveries of each aggregate follow commit
// order. In table mode only pairs whose seq order agrees with their commit
// order are promised (producers that lock their aggregate always give
// such pairs); in log mode every pair is, in keyed order. Events ever parked are left out:
// unparked, they go after the events published meanwhile, as documented.
func (s *Sim) checkOrder(keyed map[int][]*simEvent, byN map[int][]Delivery) []Violation {
	var out []Violation
	for key, es := range keyed {
		type first struct {
			e *simEvent
			c int
		}
		var fs []first
		for _, e := range es {
			if e.everParked || len(byN[e.spec.N]) == 0 {
				continue
			}
			c := byN[e.spec.N][0].Counter
			for _, d := range byN[e.spec.N] {
				c = min(c, d.Counter)
			}
			fs = append(fs, first{e, c})
		}
		for i := range fs {
			for j := i + 1; j < len(fs); j++ {
				a, b := fs[i], fs[j] // a before b in keyed order
				if !s.promised(a.e, b.e) {
					continue
				}
				if b.c < a.c {
					p := PromiseOrder
					if a.e.handedOff || b.e.handedOff {
						p = PromiseOrderHandoff
					}
					out = append(out, Violation{p, fmt.Sprintf("aggregate k%d: #%d (commit %d) first delivered after #%d (commit %d)",
						key, a.e.spec.N, a.e.w.CommitPos, b.e.spec.N, b.e.w.CommitPos)})
				}
			}
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Detail < out[j].Detail })
	return out
}

func deliveredIn(ds []Delivery, after, upTo int) bool {
	_, ok := firstIn(ds, after, upTo)
	return ok
}

// firstIn returns the first delivery with a counter in (after, upTo].
func firstIn(ds []Delivery, after, upTo int) (Delivery, bool) {
	for _, d := range ds {
		if d.Counter > after && d.Counter <= upTo {
			return d, true
		}
	}
	return Delivery{}, false
}
