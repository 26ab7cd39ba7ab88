package core

import "time"

// Observer receives the relay's measurements. The relay calls it on its hot
// path, so implementations must be cheap and must not block.
type Observer interface {
	// Claimed reports a claim of n events that took d.
	Claimed(n int, d time.Duration)
	// Published reports one publish attempt; err is nil on success.
	Published(e *Event, d time.Duration, err error)
	// Completed reports a recorded batch outcome that took d.
	Completed(done, failed int, d time.Duration)
	// Errored reports a relay-level error (claim or complete failed).
	Errored(op string, err error)
	// Rejected reports a claimed row the relay holds because it cannot be
	// turned into an event (see Rejecter). e carries no payload.
	Rejected(e *Event, err error)
}

type nopObserver struct{}

var _ Observer = nopObserver{}

func (nopObserver) Claimed(int, time.Duration)             {}
func (nopObserver) Published(*Event, time.Duration, error) {}
func (nopObserver) Completed(int, int, time.Duration)      {}
func (nopObserver) Errored(string, error)                  {}
func (nopObserver) Rejected(*Event, error)                 {}

// Observers fans measurements out to each observer in turn, so a program
// can run metrics and its own instrumentation side by side.
type Observers []Observer

var _ Observer = Observers(nil)

// Claimed implements Observer.
func (m Observers) Claimed(n int, d time.Duration) {
	for _, o := range m {
		o.Claimed(n, d)
	}
}

// Published implements Observer.
func (m Observers) Published(e *Event, d time.Duration, err error) {
	for _, o := range m {
		o.Published(e, d, err)
	}
}

// Completed implements Observer.
func (m Observers) Completed(done, failed int, d time.Duration) {
	for _, o := range m {
		o.Completed(done, failed, d)
	}
}

// Errored implements Observer.
func (m Observers) Errored(op string, err error) {
	for _, o := range m {
		o.Errored(op, err)
	}
}

// Rejected implements Observer.
func (m Observers) Rejected(e *Event, err error) {
	for _, o := range m {
		o.Rejected(e, err)
	}
}
