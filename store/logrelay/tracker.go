package logrelay

import (
	"sync"

	"github.com/jackc/pglogrepl"
)

// tracker knows which position of the slot may be confirmed: the end of
// the latest transaction that it and every transaction before it have
// all their events done (published and recorded). Transactions finish out
// of order across lanes; the position moves only over a finished prefix.
type tracker struct {
	mu        sync.Mutex
	txns      []*txn // in commit order, oldest first
	confirmed pglogrepl.LSN
	// eventsEnd is the end of the latest confirmable transaction that had
	// events: confirmed moves past it with idle WAL too.
	eventsEnd pglogrepl.LSN
}

type txn struct {
	xid       uint32        // its transaction id, from the begin message
	end       pglogrepl.LSN // end of the commit record; set at commit
	committed bool          // the commit message has arrived
	remaining int           // events not done yet
	events    int
	// msgs are its log-only events' seqs, for the ledger; the reader's
	// alone.
	msgs []int64
}

func newTracker(start pglogrepl.LSN) *tracker { return &tracker{confirmed: start} }

// begin opens a transaction at the end of the list.
func (t *tracker) begin() *txn {
	x := &txn{}
	t.mu.Lock()
	t.txns = append(t.txns, x)
	t.mu.Unlock()
	return x
}

// add counts one more event of x that must be done before x is.
func (t *tracker) add(x *txn) {
	t.mu.Lock()
	x.remaining++
	x.events++
	t.mu.Unlock()
}

// commit records where x ends. A transaction without events (one that
// carries only other prefixes' logical messages) behind another is folded
// into it: confirming that one's end then confirms this one's too, and
// the list stays as long as the transactions with events in flight,
// however many such transactions pass while one event is stuck.
func (t *tracker) commit(x *txn, end pglogrepl.LSN) {
	t.mu.Lock()
	x.end, x.committed = end, true
	if n := len(t.txns); x.events == 0 && n >= 2 && t.txns[n-1] == x && t.txns[n-2].committed {
		t.txns[n-2].end = end
		t.txns[n-1] = nil
		t.txns = t.txns[:n-1]
	}
	t.advance()
	t.mu.Unlock()
}

// done records one event of x as done.
func (t *tracker) done(x *txn) {
	t.mu.Lock()
	x.remaining--
	t.advance()
	t.mu.Unlock()
}

func (t *tracker) advance() {
	n := 0
	for _, x := range t.txns {
		if !x.committed || x.remaining > 0 {
			break
		}
		t.confirmed = max(t.confirmed, x.end)
		if x.events > 0 {
			t.eventsEnd = max(t.eventsEnd, x.end)
		}
		n++
	}
	if n > 0 {
		clear(t.txns[:n])
		t.txns = t.txns[n:]
	}
}

// idleAt moves the position to lsn, a point the server has decoded up to
// (a keepalive between transactions), when nothing is outstanding: an idle
// slot confirms progress, so it does not hold WAL back.
func (t *tracker) idleAt(lsn pglogrepl.LSN) {
	t.mu.Lock()
	if len(t.txns) == 0 {
		t.confirmed = max(t.confirmed, lsn)
	}
	t.mu.Unlock()
}

// lastEvents returns the end of the latest confirmable transaction with
// events.
func (t *tracker) lastEvents() pglogrepl.LSN {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.eventsEnd
}

// position returns the position that may be confirmed and how many
// transactions are outstanding.
func (t *tracker) position() (pglogrepl.LSN, int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.confirmed, len(t.txns)
}
