package core

import "context"

// Holder is an optional Source capability for a source that must hold
// something before its relay claims, such as a lock that keeps two kinds
// of relay off one outbox. Hold runs for the relay's life, until ctx is
// done: the relay claims only after Hold called held, and a Hold that
// returns first (with another mode's relay on the same outbox, or a lost
// lock) stops the relay, whose Run and Stop then return Hold's error.
type Holder interface {
	Hold(ctx context.Context, held func()) error
}
