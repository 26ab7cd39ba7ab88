package oracle

import (
	"reflect"
	"slices"
	"testing"
	"time"
)

// fake feeds the model hand-written histories and broker records, so
// that each promise is seen to fail when its record breaks it.
type fake struct {
	t   *testing.T
	s   *Sim
	rec []Delivery
	pos int
	seq int64
	tx  int
	ids map[int]string
}

func newFake(t *testing.T, mode Mode) *fake {
	return &fake{t: t, s: NewSim(mode), ids: map[int]string{}}
}

// write commits (or rolls back) events in this order, in one
// transaction: commit positions and seqs both follow it unless set by
// writeAt.
func (f *fake) write(committed bool, es ...EventSpec) {
	f.tx++
	for _, e := range es {
		f.pos++
		f.seq++
		f.writeAt(e, committed, f.pos, f.seq, time.Time{})
	}
}

func (f *fake) writeAt(e EventSpec, committed bool, pos int, seq int64, deliverAt time.Time) {
	f.ids[e.N] = "id-" + string(rune('A'+e.N))
	w := Written{ID: f.ids[e.N], Committed: committed, CommitPos: -1, DeliverAt: deliverAt, Tx: f.tx}
	if committed {
		w.CommitPos = pos
		if e.Producer.Row() {
			w.Seq = seq
		}
	}
	f.s.Wrote(e, w)
}

func (f *fake) deliver(ns ...int) {
	for _, n := range ns {
		f.deliverAt(n, time.Now())
	}
}

func (f *fake) deliverAt(n int, at time.Time) {
	id, ok := f.ids[n]
	if !ok {
		id, n = "stranger", -1
	}
	f.rec = append(f.rec, Delivery{N: n, ID: id, Counter: len(f.rec) + 1, At: at})
}

// settle opens a settle point, delivers ns (what the relay does while the
// driver waits), closes the point and returns the labels owed, sorted.
func (f *fake) settle(running bool, ns ...int) []int {
	owed := f.s.Settle(running)
	f.deliver(ns...)
	f.s.Seal(len(f.rec))
	var out []int
	for n := range owed {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

func (f *fake) op(kind StepKind, n int) { f.s.Operate(Step{Kind: kind, Target: n}, len(f.rec), true) }

// promises returns the promises the record breaks, sorted and distinct.
func (f *fake) promises() []Promise {
	var out []Promise
	for _, v := range f.s.Check(f.rec) {
		if !slices.Contains(out, v.Promise) {
			out = append(out, v.Promise)
		}
	}
	slices.Sort(out)
	return out
}

func (f *fake) want(ps ...Promise) {
	f.t.Helper()
	slices.Sort(ps)
	if got := f.promises(); !reflect.DeepEqual(got, ps) && (len(got) > 0 || len(ps) > 0) {
		f.t.Errorf("broken promises %v, want %v; violations: %v", got, ps, f.s.Check(f.rec))
	}
}

func e(n, key int, p Producer) EventSpec { return EventSpec{N: n, Key: key, Producer: p} }

func TestSimDeliveryAndOrder(t *testing.T) {
	t.Run("all delivered in order", func(t *testing.T) {
		f := newFake(t, TableOrdered)
		f.write(true, e(1, 1, GoRows), e(2, 1, SQLFunc), e(3, 2, SQLInsert))
		// Other aggregates interleave; a duplicate is allowed.
		if got := f.settle(true, 3, 1, 2, 1); !reflect.DeepEqual(got, []int{1, 2, 3}) {
			t.Fatalf("owed %v, want [1 2 3]", got)
		}
		f.want()
	})
	t.Run("one missing", func(t *testing.T) {
		f := newFake(t, TableUnordered)
		f.write(true, e(1, 1, GoRows), e(2, 1, GoRows))
		f.deliver(2)
		f.settle(true)
		f.want(PromiseDelivery)
	})
	t.Run("reordered", func(t *testing.T) {
		for _, mode := range Modes {
			f := newFake(t, mode)
			p := GoRows
			if mode == LogOnly {
				p = GoLog
			}
			f.write(true, e(1, 1, p), e(2, 1, p))
			f.deliver(2, 1)
			f.settle(true)
			if mode.Ordered() {
				f.want(PromiseOrder)
			} else {
				f.want()
			}
		}
	})
	t.Run("table mode promises order only where seq and commit order agree", func(t *testing.T) {
		f := newFake(t, TableOrdered)
		// #1 took seq 1 but committed after #2, which took seq 2: unlocked
		// producers; either delivery order is allowed.
		f.writeAt(e(1, 1, GoRows), true, 2, 1, time.Time{})
		f.writeAt(e(2, 1, GoRows), true, 1, 2, time.Time{})
		f.writeAt(e(3, 1, GoRows), true, 3, 3, time.Time{})
		f.deliver(2, 1, 3)
		f.settle(true)
		f.want()
		g := newFake(t, TableOrdered)
		g.writeAt(e(1, 1, GoRows), true, 2, 1, time.Time{})
		g.writeAt(e(2, 1, GoRows), true, 1, 2, time.Time{})
		g.writeAt(e(3, 1, GoRows), true, 3, 3, time.Time{})
		g.deliver(3, 2, 1) // #3 is after both in seq and commit order
		g.settle(true)
		g.want(PromiseOrder)
	})
	t.Run("log mode promises commit order", func(t *testing.T) {
		f := newFake(t, LogRows)
		f.writeAt(e(1, 1, GoRows), true, 2, 1, time.Time{})
		f.writeAt(e(2, 1, GoRows), true, 1, 2, time.Time{})
		f.deliver(1, 2)
		f.settle(true)
		f.want(PromiseOrder)
	})
	t.Run("order across the table path is its own promise", func(t *testing.T) {
		f := newFake(t, LogRows)
		f.write(true, e(1, 1, GoRows), e(2, 1, GoLog))
		f.s.HandedOff(2)
		f.deliver(2, 1)
		f.settle(true)
		f.want(PromiseOrderHandoff)
	})
}

func TestSimNoPhantom(t *testing.T) {
	f := newFake(t, TableOrdered)
	f.write(false, e(1, 1, GoRows))
	f.write(true, e(2, 1, GoRows))
	f.settle(true, 2)
	f.want()
	f.deliver(1)
	f.want(PromiseNoPhantom)

	g := newFake(t, TableOrdered)
	g.deliver(99) // an event no one wrote
	g.settle(true)
	g.want(PromiseNoPhantom)
}

func TestSimHeldScheduledParked(t *testing.T) {
	far := EventSpec{N: 2, Key: 1, Producer: GoRows, Sched: Far}
	t.Run("a far-scheduled event holds back only the later events", func(t *testing.T) {
		f := newFake(t, TableOrdered)
		f.write(true, e(1, 1, GoRows), far, e(3, 1, GoRows), e(4, 2, GoRows))
		if got := f.settle(true, 1, 4); !reflect.DeepEqual(got, []int{1, 4}) {
			t.Fatalf("owed %v, want [1 4]", got)
		}
		f.want()
	})
	t.Run("the earlier event held back too", func(t *testing.T) {
		f := newFake(t, TableOrdered)
		f.write(true, e(1, 1, GoRows), far, e(3, 2, GoRows))
		f.deliver(3)
		f.settle(true)
		f.want(PromiseOnlyLaterBlocked)
	})
	t.Run("a later event delivered", func(t *testing.T) {
		f := newFake(t, LogOnly)
		far := far
		far.Producer = GoLog
		f.write(true, e(1, 1, GoLog), far, e(3, 1, GoLog))
		f.deliver(1, 3)
		f.settle(true)
		f.want(PromiseBlocked)
	})
	t.Run("unordered mode lets later events pass", func(t *testing.T) {
		f := newFake(t, TableUnordered)
		f.write(true, e(1, 1, GoRows), far, e(3, 1, GoRows))
		if got := f.settle(true); !reflect.DeepEqual(got, []int{1, 3}) {
			t.Fatalf("owed %v, want [1 3]", got)
		}
		f.deliver(1)
		f.want(PromiseDelivery)
	})
	t.Run("a held event, retried, goes out and releases the later ones", func(t *testing.T) {
		f := newFake(t, TableOrdered)
		f.write(true, EventSpec{N: 1, Key: 1, Producer: GoRows, Fault: Permanent}, e(2, 1, GoRows))
		if got := f.settle(true); len(got) != 0 {
			t.Fatalf("owed %v while #1 is held", got)
		}
		f.op(Retry, 1)
		if got := f.settle(true, 1, 2); !reflect.DeepEqual(got, []int{1, 2}) {
			t.Fatalf("owed %v after the retry, want [1 2]", got)
		}
		f.want()
	})
	t.Run("delivered before its retry", func(t *testing.T) {
		f := newFake(t, TableOrdered)
		f.write(true, EventSpec{N: 1, Key: 1, Producer: GoRows, Fault: Permanent}, e(2, 1, GoRows))
		f.deliver(2)
		f.settle(true)
		f.op(Retry, 1)
		f.deliver(1)
		f.settle(true)
		f.want(PromiseBlocked, PromiseOrder)
	})
	t.Run("a bad row stays held when retried; parked, it lets the later ones go", func(t *testing.T) {
		f := newFake(t, TableOrdered)
		f.write(true, EventSpec{N: 1, Key: 1, Producer: SQLInsert, Fault: Bad}, e(2, 1, GoRows))
		f.settle(true)
		f.op(Retry, 1)
		if got := f.settle(true); len(got) != 0 {
			t.Fatalf("owed %v after retrying a bad row", got)
		}
		f.op(Park, 1)
		if got := f.settle(true, 2); !reflect.DeepEqual(got, []int{2}) {
			t.Fatalf("owed %v after the park, want [2]", got)
		}
		f.want()
		f.op(Unpark, 1)
		f.write(true, e(3, 1, GoRows))
		f.settle(true)
		f.deliver(3) // behind the unparked bad row again
		f.settle(true)
		f.want(PromiseBlocked)
	})
	t.Run("a parked event delivered", func(t *testing.T) {
		f := newFake(t, TableUnordered)
		f.write(true, EventSpec{N: 1, Key: 1, Producer: GoRows, Fault: Permanent})
		f.settle(true)
		f.op(Park, 1)
		f.op(Retry, 1)
		f.settle(true)
		f.deliver(1)
		f.settle(true)
		f.want(PromiseBlocked)
	})
	t.Run("a scheduled event delivered early", func(t *testing.T) {
		f := newFake(t, TableOrdered)
		f.writeAt(EventSpec{N: 1, Key: 1, Producer: GoRows, Sched: Soon}, true, 1, 1, time.Now().Add(time.Second))
		f.deliverAt(1, time.Now())
		f.settle(true)
		f.want(PromiseNotBeforeDue)
	})
}

func TestSimReplayAndSlot(t *testing.T) {
	t.Run("replayed and delivered again", func(t *testing.T) {
		f := newFake(t, LogRows)
		f.write(true, e(1, 1, GoRows))
		f.settle(true, 1)
		f.op(Replay, 1)
		if got := f.settle(true, 1); !reflect.DeepEqual(got, []int{1}) {
			t.Fatalf("owed %v after the replay, want [1]", got)
		}
		f.want()
	})
	t.Run("replay lost", func(t *testing.T) {
		f := newFake(t, LogRows)
		f.write(true, e(1, 1, GoRows))
		f.settle(true, 1)
		f.op(Replay, 1)
		f.settle(true)
		f.want(PromiseReplay)
	})
	t.Run("a log-only write before the slot is refused", func(t *testing.T) {
		f := newFake(t, LogRows)
		// The row of its transaction rolls back with it.
		f.s.Wrote(e(1, 1, GoRows), Written{ID: "a", CommitPos: -1, Tx: 1, BeforeSlot: true, Refused: true})
		f.s.Wrote(e(2, 1, SQLLogWrite), Written{ID: "b", CommitPos: -1, Tx: 1, BeforeSlot: true, Refused: true})
		f.s.Wrote(e(3, 1, GoRows), Written{ID: "c", Committed: true, CommitPos: 1, Seq: 2, Tx: 2, BeforeSlot: true})
		f.ids[3] = "c"
		if got := f.settle(true, 3); !reflect.DeepEqual(got, []int{3}) {
			t.Fatalf("owed %v, want [3]", got)
		}
		f.want()
	})
	t.Run("a refused transaction's row delivered", func(t *testing.T) {
		f := newFake(t, LogRows)
		f.ids[1] = "a"
		f.s.Wrote(e(1, 1, GoRows), Written{ID: "a", CommitPos: -1, Tx: 1, BeforeSlot: true, Refused: true})
		f.s.Wrote(e(2, 1, GoLog), Written{ID: "b", CommitPos: -1, Tx: 1, BeforeSlot: true, Refused: true})
		f.settle(true, 1)
		f.want(PromiseNoPhantom)
	})
	t.Run("a log-only write before the slot not refused", func(t *testing.T) {
		f := newFake(t, LogOnly)
		f.s.Wrote(e(1, 1, GoLog), Written{ID: "a", Committed: true, CommitPos: 1, Tx: 1, BeforeSlot: true})
		f.settle(true) // lost: no slot read it
		f.want(PromiseRefusedBeforeSlot)
	})
	t.Run("a write refused with the slot in place", func(t *testing.T) {
		f := newFake(t, LogOnly)
		f.s.Wrote(e(1, 1, GoLog), Written{ID: "a", CommitPos: -1, Tx: 1, Refused: true})
		f.settle(true)
		f.want(PromiseRefusedBeforeSlot)
	})
	t.Run("a transaction of rows refused before the slot", func(t *testing.T) {
		f := newFake(t, LogRows)
		f.s.Wrote(e(1, 1, GoRows), Written{ID: "a", CommitPos: -1, Tx: 1, BeforeSlot: true, Refused: true})
		f.settle(true)
		f.want(PromiseRefusedBeforeSlot)
	})
	t.Run("rows before the slot go out in seq order, not commit order", func(t *testing.T) {
		f := newFake(t, LogRows)
		f.ids[1], f.ids[2], f.ids[3] = "a", "b", "c"
		// #1 took its seq first and committed second.
		f.s.Wrote(e(1, 1, SQLInsert), Written{ID: "a", Committed: true, CommitPos: 2, Seq: 1, Tx: 1, BeforeSlot: true})
		f.s.Wrote(e(2, 1, SQLInsert), Written{ID: "b", Committed: true, CommitPos: 1, Seq: 2, Tx: 2, BeforeSlot: true})
		f.s.Wrote(e(3, 1, SQLInsert), Written{ID: "c", Committed: true, CommitPos: 3, Seq: 3, Tx: 3})
		f.settle(true, 1, 2, 3)
		f.want()
	})
	t.Run("rows before the slot in commit order, against seq order", func(t *testing.T) {
		f := newFake(t, LogRows)
		f.ids[1], f.ids[2] = "a", "b"
		f.s.Wrote(e(1, 1, SQLInsert), Written{ID: "a", Committed: true, CommitPos: 2, Seq: 1, Tx: 1, BeforeSlot: true})
		f.s.Wrote(e(2, 1, SQLInsert), Written{ID: "b", Committed: true, CommitPos: 1, Seq: 2, Tx: 2, BeforeSlot: true})
		f.settle(true, 2, 1)
		f.want(PromiseOrder)
	})
	t.Run("a row after the slot ahead of one before it", func(t *testing.T) {
		f := newFake(t, LogRows)
		f.ids[1], f.ids[2] = "a", "b"
		f.s.Wrote(e(1, 1, SQLInsert), Written{ID: "a", Committed: true, CommitPos: 1, Seq: 2, Tx: 1, BeforeSlot: true})
		f.s.Wrote(e(2, 1, SQLInsert), Written{ID: "b", Committed: true, CommitPos: 2, Seq: 1, Tx: 2})
		f.settle(true, 2, 1)
		f.want(PromiseOrder)
	})
	t.Run("nothing owed while the relay is stopped", func(t *testing.T) {
		f := newFake(t, TableOrdered)
		f.write(true, e(1, 1, GoRows), e(2, 1, GoRows))
		f.deliver(1) // before the stop
		if got := f.settle(false); len(got) != 0 {
			t.Fatalf("owed %v with the relay stopped", got)
		}
		f.op(Park, 2)
		if got := f.settle(true); !reflect.DeepEqual(got, []int{1}) {
			t.Fatalf("owed %v, want [1]", got)
		}
		f.want()
	})
}

func TestGenerate(t *testing.T) {
	for _, mode := range Modes {
		a, b := Generate(mode, 42, Shape{Steps: 12}), Generate(mode, 42, Shape{Steps: 12})
		if a.String() != b.String() {
			t.Fatalf("%s: one seed gave two histories:\n%s\n%s", mode, a, b)
		}
		for seed := range uint64(200) {
			h := Generate(mode, seed, Shape{Steps: 10, RestartPostgres: true})
			for _, s := range h.Steps {
				stopper := false
				for _, tx := range s.Txs {
					for _, e := range tx.Events {
						if !mode.Log() && !e.Producer.Row() {
							t.Fatalf("%s: a log-only event in table mode:\n%s", mode, h)
						}
						if mode == LogOnly && e.Producer.Row() {
							t.Fatalf("log-only: a row:\n%s", h)
						}
						stopper = stopper || e.Sched == Far || e.Fault == Permanent || e.Fault == Bad
					}
				}
				if len(s.Txs) > 1 && stopper {
					for _, tx := range s.Txs {
						if !tx.Lock {
							t.Fatalf("%s: concurrent transactions with a held or scheduled event, one unlocked:\n%s", mode, h)
						}
					}
				}
			}
		}
	}
}

func TestNormalizeDropsActionsOnEventsGone(t *testing.T) {
	h := History{Steps: []Step{
		{Kind: Write, Txs: []Tx{{Events: nil}}},
		{Kind: Park, Target: 1},
		{Kind: Write, Txs: []Tx{{Events: []EventSpec{{N: 1}}}}},
		{Kind: Replay, Target: 1},
	}}
	got := h.Normalize().Steps
	if len(got) != 2 || got[0].Kind != Write || got[1].Kind != Replay {
		t.Fatalf("normalized to %v", got)
	}
}

func TestSimBlamesTheLostEvent(t *testing.T) {
	f := newFake(t, LogOnly)
	// #1 should have been refused; it committed, and no slot read it.
	f.s.Wrote(EventSpec{N: 1, Key: 1, Producer: GoLog, Sched: Far}, Written{ID: "a", Committed: true, CommitPos: 1, Tx: 1, BeforeSlot: true})
	f.ids[2] = "b"
	f.s.Wrote(e(2, 1, GoLog), Written{ID: "b", Committed: true, CommitPos: 2, Tx: 2})
	f.settle(true, 2) // #1 was lost, so #2 went out
	f.want(PromiseRefusedBeforeSlot)
}

// Held names the events a running relay has tried and recorded held: in
// ordered modes the first of its aggregate (the later ones are not tried),
// in unordered mode each; none once retried, none with the relay stopped.
func TestSimHeld(t *testing.T) {
	perm := func(n, key int) EventSpec { return EventSpec{N: n, Key: key, Producer: GoRows, Fault: Permanent} }
	bad := func(n, key int) EventSpec { return EventSpec{N: n, Key: key, Producer: SQLInsert, Fault: Bad} }
	far := EventSpec{N: 5, Key: 3, Producer: GoRows, Sched: Far}
	for _, c := range []struct {
		mode Mode
		want []int
	}{{TableOrdered, []int{1, 4}}, {LogRows, []int{1, 4}}, {TableUnordered, []int{1, 2, 4, 6}}} {
		f := newFake(t, c.mode)
		f.write(true, perm(1, 1), bad(2, 1), e(3, 1, GoRows), bad(4, 2), far, perm(6, 3))
		f.settle(false)
		if got := f.s.Held(); len(got) != 0 {
			t.Errorf("%s: held %v with the relay stopped, want none", c.mode, got)
		}
		f.settle(true)
		got := slices.Sorted(slices.Values(f.s.Held()))
		if !reflect.DeepEqual(got, c.want) {
			t.Errorf("%s: held %v, want %v", c.mode, got, c.want)
		}
		f.op(Retry, 1)
		f.settle(true, 1)
		if got := slices.Sorted(slices.Values(f.s.Held())); slices.Contains(got, 1) {
			t.Errorf("%s: held %v after #1's retry", c.mode, got)
		}
	}
}

func TestSimExactlyOnce(t *testing.T) {
	t.Run("a duplicate breaks the promise", func(t *testing.T) {
		f := newFake(t, TableOrdered)
		f.s.ExactlyOnce()
		f.write(true, e(1, 1, GoRows), e(2, 2, GoRows))
		f.settle(true, 1, 2, 1)
		f.want(PromiseNoDuplicate)
	})
	t.Run("once each is kept", func(t *testing.T) {
		f := newFake(t, TableOrdered)
		f.s.ExactlyOnce()
		f.write(true, e(1, 1, GoRows), e(2, 2, GoRows))
		f.settle(true, 1, 2)
		f.want()
	})
	t.Run("a replay allows one more", func(t *testing.T) {
		f := newFake(t, TableOrdered)
		f.s.ExactlyOnce()
		f.write(true, e(1, 1, GoRows))
		f.settle(true, 1)
		f.op(Replay, 1)
		f.s.Replayed(1)
		f.settle(true, 1)
		f.want()
		f.deliver(1)
		f.settle(true)
		f.want(PromiseNoDuplicate)
	})
	t.Run("a lost replay is the replay's", func(t *testing.T) {
		f := newFake(t, TableOrdered)
		f.s.ExactlyOnce()
		f.write(true, e(1, 1, GoRows))
		f.settle(true, 1)
		f.op(Replay, 1)
		f.write(true, EventSpec{N: 2, Key: 1, Producer: GoRows, Fault: Permanent})
		f.settle(true)
		// Without exactly-once, the later held event would be blamed.
		f.want(PromiseReplay)
	})
}
