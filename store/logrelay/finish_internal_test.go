package logrelay

import (
	"runtime"
	"testing"

	"github.com/jackc/pglogrepl"
)

// A drain stops waiting once nothing is in flight and confirms the
// tracker's position: by then every finished event must be in it. The
// count used to drop before the tracker heard, so a drain could confirm
// a position short of the transactions it had published, and the next
// relay republished them.
func TestFinishRecordsBeforeTheCountDrops(t *testing.T) {
	for i := range 20000 {
		s := &stream{r: &Relay{}, tracker: newTracker(0), freed: make(chan struct{}, 1)}
		x := s.tracker.begin()
		it := &item{txn: x, size: 1}
		s.tracker.add(x)
		s.events.Add(1)
		end := pglogrepl.LSN(100 + i)
		s.tracker.commit(x, end)
		go s.finish(it)
		for s.events.Load() > 0 {
			runtime.Gosched()
		}
		if pos, _ := s.tracker.position(); pos != end {
			t.Fatalf("iteration %d: nothing in flight but the position is %s, want %s", i, pos, end)
		}
	}
}
