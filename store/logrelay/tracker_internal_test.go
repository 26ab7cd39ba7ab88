package logrelay

import (
	"testing"

	"github.com/jackc/pglogrepl"
)

// Transactions that carry no event of this outbox (only other prefixes'
// logical messages) while one event is stuck keep the tracker's list
// short, and the position still moves past them once the event is done.
// Before they were folded, the list held one entry per transaction.
func TestTrackerFoldsTransactionsWithoutEvents(t *testing.T) {
	tr := newTracker(10)
	stuck := tr.begin()
	tr.add(stuck)
	tr.commit(stuck, 100)
	for i := range 100000 {
		x := tr.begin()
		tr.commit(x, pglogrepl.LSN(200+i))
	}
	if pos, n := tr.position(); n > 2 || pos != 10 {
		t.Fatalf("position %s with %d transactions outstanding, want 0/A with at most 2", pos, n)
	}
	tr.done(stuck)
	if pos, n := tr.position(); n != 0 || pos != 200+99999 {
		t.Fatalf("position %s with %d outstanding after the event is done, want %s and 0", pos, n, pglogrepl.LSN(200+99999))
	}
	// A transaction with events behind an open one is not folded.
	a := tr.begin()
	tr.add(a)
	tr.commit(a, 300000)
	b := tr.begin()
	tr.add(b)
	tr.commit(b, 300100)
	tr.done(b)
	if pos, _ := tr.position(); pos != 200+99999 {
		t.Fatalf("position %s moved past an event not done", pos)
	}
}
