package core

import (
	"context"
	"time"
)

// Source is where the relay finds committed events. Implementations must make
// concurrent claims disjoint: no event is in two open claims at once.
type Source interface {
	// Claim takes up to req.Limit pending events in seq order and holds them
	// until the returned Claim is completed or released. An empty claim is
	// valid. In ordered mode the source returns an event only when every
	// earlier pending event of its aggregate is in the same claim or in
	// req.InFlight.
	Claim(ctx context.Context, req ClaimOptions) (Claim, error)
}

// ClaimOptions says how many events to claim and whether order matters.
type ClaimOptions struct {
	Limit     int
	Unordered bool
	// InFlight lists the seqs of events the caller holds in its own open
	// claims and publishes, in order, before any event of their aggregates
	// that this claim returns. In ordered mode they count as part of this claim for
	// the gate, so a relay can claim the next events of an aggregate while
	// earlier ones are still on their way. Events whose publish failed do
	// not belong here: left out, they hold their aggregate back. Events of
	// another relay's claims must never be listed.
	InFlight []int64
	// HeldBack lists aggregates the caller holds back: it holds an earlier
	// event of each that it does not list in InFlight (a publish that
	// stalls, or an aggregate with enough queued already). In ordered mode
	// the source may leave their events out of the scan altogether, so
	// they do not take the room of other aggregates' events; it is a
	// hint, the gate holds them back either way.
	HeldBack []string
}

// Claim is a set of events held by one relay.
type Claim interface {
	Events() []Event
	// Complete marks done as dispatched, records failed, and ends the claim.
	// Events in neither list stay pending, untouched.
	Complete(ctx context.Context, done []int64, failed []Failure) error
	// Release ends the claim and records nothing.
	Release(ctx context.Context) error
}

// Truncated is an optional Claim capability: Truncated reports that the
// source left pending events out of the claim (other relays hold earlier
// events of their aggregates, or the claim reached its byte limit). Work is
// waiting, so the relay comes back after a short pause instead of its poll
// interval.
type Truncated interface {
	Truncated() bool
}

// Rejecter is an optional Claim capability: Rejected lists claimed rows the
// source could not turn into events (headers of the wrong shape, a payload
// over its size limit). The relay holds each one in Complete like a
// permanent publish failure, so a bad row never stops the other aggregates
// and is never dropped.
type Rejecter interface {
	Rejected() []Rejection
}

// HandOffer is an optional Claim capability of a source that cannot offer
// an event again, such as a replication stream: an event it gives out is
// either published or handed off, to a place where it waits and is offered
// again (the outbox table), never left pending. The relay calls both
// methods from the event's lane, so one aggregate's hand-offs happen in its
// order; a failed hand-off is retried with ErrorBackoff until it succeeds
// or the relay stops. For such a claim a transient publish failure is
// retried in place (see Options.HandOffAfter) and Complete gets no
// failures: the hand-offs have recorded them.
type HandOffer interface {
	// MustHandOff reports whether e goes to the hand-off place instead of
	// the broker: an earlier event of its aggregate waits there, or e is
	// not due yet, or it cannot be published at all.
	MustHandOff(ctx context.Context, e *Event) (bool, error)
	// HandOff hands e off: held with f's reason (retried at f.RetryAt
	// when set), or, with f nil, as the source decides (waiting, or held
	// when it cannot be published at all).
	HandOff(ctx context.Context, e *Event, f *Failure) error
}

// Notifier is an optional Source capability: Listen calls wake soon after new
// events commit, until ctx is done. It reconnects by itself after a dropped
// connection and returns only when ctx is done.
type Notifier interface {
	Listen(ctx context.Context, wake func()) error
}

// Sleeper is an optional capability of a Notifier whose producers wake a
// relay only while one sleeps, so that a busy relay costs them nothing:
// the relay says when it is about to wait for a wake-up, and when it woke.
type Sleeper interface {
	// Sleep asks producers to wake the relay from now on, and returns
	// without waiting for them. now means every event committed without
	// waking the relay is visible to a claim made now (the relay claims
	// once more); otherwise producers that wrote without waking it are
	// still open, and the source wakes the relay (and every other sleeping
	// one) once they have committed. After an error, or a failure Sleep
	// cannot report, the relay relies on its poll interval, and makes the
	// sleep anew after each poll.
	Sleep(ctx context.Context) (now bool, err error)
	// Awake ends Sleep's effect: producers stop waking the relay.
	Awake(ctx context.Context) error
}

// Sharer is an optional Source capability for ordered mode: Share runs for
// the relay's life, until ctx is done, and divides the source's ordered work
// between the relays that share it, so that each claims from its own share
// (the table source: partitions of aggregates, each owned by one relay
// at a time). It calls changed with the relay's share, from 0 to 1 of the
// work, whenever the share changes (the relay then claims at once, and
// opens its share of Options.Claimers), and reconnects by itself. Sharing
// only keeps relays out of each other's way: claims must stay disjoint and
// ordered whatever the shares, as when a relay that lost partitions still
// has claims open in them.
type Sharer interface {
	Share(ctx context.Context, changed func(share float64)) error
}

// Pinger is an optional capability of a Source or Publisher: it reports
// whether the backing server is reachable, for readiness checks. A Ping
// that cannot ask its server returns an error wrapping
// errors.ErrUnsupported: the server then counts as neither up nor down
// (readiness and the relay's outage probe ignore it; the log relay does
// not take it for a broker that answers).
type Pinger interface {
	Ping(ctx context.Context) error
}

// BacklogReader is an optional Source capability: it counts the events
// still to publish, for the backlog gauges (core/metrics.Poller).
// stuckAfter is how long an event may wait before it counts as stuck;
// zero means the source's default.
type BacklogReader interface {
	Backlog(ctx context.Context, stuckAfter time.Duration) (Backlog, error)
}

// Backlog is a snapshot of the events not yet published.
type Backlog struct {
	Pending  int64 // neither published nor parked
	Retrying int64 // pending and backing off after a transient failure
	Held     int64 // pending and held for an operator by a permanent failure
	Parked   int64 // set aside by an operator
	Stuck    int64 // due for longer than stuckAfter, or held
	// OldestPendingAge is how long the oldest pending event has been due;
	// zero when none is.
	OldestPendingAge time.Duration
}

// Holder is an optional Source capability for a source that must hold
// something before its relay claims, such as a lock that keeps two kinds
// of relay off one outbox. Hold runs for the relay's life, until ctx is
// done: the relay claims only after Hold called held, and a Hold that
// returns first (with another mode's relay on the same outbox, or a lost
// lock) stops the relay, whose Run and Stop then return Hold's error.
type Holder interface {
	Hold(ctx context.Context, held func()) error
}

// Settler is an optional Source capability, required by a publisher that
// records its progress with the broker, in the transaction that carries
// the events (exactly-once into Kafka): after a crash, that record names
// events the broker has that the source may not yet show as published.
type Settler interface {
	// Units names the source's units of ownership: Event.Unit runs from 0
	// to n-1, and the relays sharing the source publish each unit from
	// one relay at a time (the table source: its partitions; the log
	// relay: its slot). name is the same for every relay of the source,
	// and differs between sources.
	Units() (name string, n int)
	// Unsettled returns those of sent that the source may still offer
	// again: not yet recorded as published. When unsure it keeps an
	// event: keeping one costs a little memory, leaving one out a
	// duplicate.
	Unsettled(ctx context.Context, sent []Sent) ([]Sent, error)
}

// Sent names an event a publisher sent: its unit, seq, id and replays
// (Event.Replays), so that a replay made after the send is not taken for
// the send.
type Sent struct {
	Unit    int
	Seq     int64
	ID      string
	Replays int
}
