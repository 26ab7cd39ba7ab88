package logrelay_test

import (
	"testing"
	"time"

	"github.com/google/uuid"
)

// After a crash of PostgreSQL the relay sends again only what it had not
// confirmed: the server keeps a slot's confirmed position on disk only now
// and then, so its slot goes back to the last save, but the relay records
// the position it confirmed in the table (soon after each confirmation)
// and resumes from the later of the two. It used to send again every
// event since the slot was last saved.
func TestCrashOfTheServerResendsOnlyWhatWasNotConfirmed(t *testing.T) {
	e, srv := privateEnv(t)
	first := &recorder{}
	r := e.start(first, e.opts())
	waitFor(t, 10*time.Second, "the relay to hold the slot", r.r.Holding)
	const n = 200
	for i := range n / 20 {
		e.write(i%2 == 0, uuid.NewString(), 0, 20)
	}
	waitFor(t, 20*time.Second, "every event published", func() bool { return len(first.distinct()) == n && r.r.InFlight() == 0 })
	// Confirmed within 100ms of being done, recorded right after.
	time.Sleep(time.Second)
	if err := srv.Stop("immediate", 30*time.Second); err != nil {
		t.Fatal(err)
	}
	r.stop(t)
	if err := srv.Start(); err != nil {
		t.Fatalf("%v\n%s", err, srv.Log())
	}
	e.pool.Reset()
	again := &recorder{}
	r2 := e.start(again, e.opts())
	waitFor(t, 30*time.Second, "the relay to hold the slot again", r2.r.Holding)
	last := e.write(false, "after", 0, 1)[0]
	waitFor(t, 20*time.Second, "the event written after the crash", func() bool { return again.distinct()[last] > 0 })
	if resent := len(again.distinct()) - 1; resent > 0 {
		t.Fatalf("%d of %d events confirmed before the crash were sent again after it", resent, n)
	}
}
