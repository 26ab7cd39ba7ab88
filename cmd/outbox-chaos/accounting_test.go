package main

import (
	"strings"
	"testing"
	"time"
)

// The checker must be able to fail: fed a lost event, a phantom one, an
// event out of order, a duplicate and a double effect, it reports each.
func TestAccountingCatchesEveryFault(t *testing.T) {
	tl := newTally()
	tl.record("a1", "A", 1)
	tl.record("a3", "A", 3)
	tl.record("a2", "A", 2) // first seen after 3: a violation
	tl.record("a1", "A", 1) // a redelivery: a duplicate, not a violation
	tl.record("b1", "B", 1)
	tl.record("rb", "B", 2) // of a rolled-back transaction
	committed := map[string]bool{"a1": true, "a2": true, "a3": true, "b1": true, "lost": true}
	rep := &Report{Committed: len(committed), Effects: len(committed) - 1, EffectsTwice: 1}
	tl.account(rep, committed, map[string]bool{"rb": true})

	for _, c := range []struct {
		name      string
		got, want int
	}{
		{"delivered", rep.Delivered, 5},
		{"receipts", rep.Receipts, 6},
		{"duplicates", rep.Duplicates, 1},
		{"order violations", rep.OrderViolations, 1},
		{"lost", rep.Lost, 1},
		{"phantom", rep.Phantom, 1},
		{"rolled back delivered", rep.RolledBackDelivered, 1},
	} {
		if c.got != c.want {
			t.Errorf("%s: %d, want %d", c.name, c.got, c.want)
		}
	}
	err := rep.Err()
	if err == nil {
		t.Fatal("Err is nil for a run with every kind of fault")
	}
	for _, want := range []string{"lost: 1", "phantom: 1", "order violations: 1", "effects applied twice: 1", "events without effect: 1"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Err does not say %q:\n%v", want, err)
		}
	}
	rep = &Report{MaxFailedCyclesPerSecond: 50}
	if rep.Err() == nil {
		t.Error("a relay failing 50 cycles a second passes")
	}
	rep = &Report{Takeover: map[string][]time.Duration{PauseRelay: {time.Second, TakeoverSLO}}}
	if err := rep.Err(); err == nil || !strings.Contains(err.Error(), "after pause-relay no other relay read the slot") {
		t.Errorf("a takeover of %s passes: %v", TakeoverSLO, err)
	}
}

// An exactly-once run fails on a single duplicate, and the comparison
// puts each fault kind's duplicates of both paths side by side.
func TestExactlyOnceAccounting(t *testing.T) {
	plain := &Report{Broker: "kafka", Mode: "table", Duplicates: 7, Committed: 100, Effects: 100,
		Faults: map[string]int{KillRelay: 2}, FaultDuplicates: map[string][]int{KillRelay: {3, 4}}}
	eos := &Report{Broker: "kafka", Mode: "table", ExactlyOnce: true, Duplicates: 1, Committed: 100, Effects: 100,
		Faults: map[string]int{KillRelay: 2}, FaultDuplicates: map[string][]int{KillRelay: {0, 1}}}
	if err := plain.Err(); err != nil {
		t.Errorf("plain run with duplicates fails: %v", err)
	}
	if err := eos.Err(); err == nil || !strings.Contains(err.Error(), "duplicates (exactly-once, read_committed): 1, want 0") {
		t.Errorf("exactly-once run with a duplicate: %v", err)
	}
	var b strings.Builder
	PrintComparison(&b, []*Report{plain, eos})
	for _, want := range []string{"kafka table plain", "kafka table exactly-once", "7 (x2)", "1 (x2)", "7.000% of 100"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("comparison lacks %q:\n%s", want, b.String())
		}
	}
}
