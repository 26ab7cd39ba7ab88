package core

import (
	"context"
	"errors"
	"time"
)

// Event is one row of the outbox as the relay sees it.
type Event struct {
	Seq         int64             // position in the outbox table (column seq); increases in commit order per aggregate
	ID          string            // identity unique across outboxes (column event_id, a UUID)
	AggregateID string            // ordering and partition key, any string
	Type        string            // such as "order.placed"
	Payload     []byte            // the bytes exactly as written by the producer
	ContentType string            // the payload's media type; empty means application/json
	Topic       string            // set by the producer; empty leaves the topic to the routing rules
	Headers     map[string]string // the event's own headers (trace context among them)
	CreatedAt   time.Time
	Attempts    int // failed publish attempts so far
	// Replays is how many times an operator replayed the event (made it
	// pending again after it was published): each replay is a new
	// delivery, which a publisher that remembers what it sent must not
	// take for the first.
	Replays int
	// Unit is the event's unit of ownership in a source that has them
	// (Settler): from 0 to the source's count less one; 0 otherwise.
	Unit int
}

// Rejection is a claimed row that cannot be relayed. Event holds what could
// be read; its Payload is nil.
type Rejection struct {
	Event Event
	Err   error
}

// Failure is a failed publish to record against an event.
type Failure struct {
	Seq    int64
	Reason string
	// RetryAt is when the event may be claimed again. The zero time holds the
	// event until an operator retries or parks it (a permanent failure).
	RetryAt time.Time
}

// Publisher sends one event to a broker and returns nil only once the broker
// has it durably. It must be safe for concurrent use: the relay calls it from
// several lanes at once, never with two events of one aggregate concurrently.
// ctx carries the publish's deadline (PublishTimeout); a lane reuses it for
// its next publish, so it must not be kept after Publish returns.
type Publisher interface {
	Publish(ctx context.Context, e *Event) error
	Close() error
}

// Binder is an optional Publisher capability: Bind returns the publisher
// a relay uses for src's events, for a publisher that keeps state with
// each source (the exactly-once Kafka publisher keeps a transactional
// producer per unit of src, and asks src which events it sent are
// settled, see Settler). New calls it once per relay; it may refuse a
// source that lacks what it needs, and the relay is not made.
type Binder interface {
	Bind(src Source) (Publisher, error)
}

// Committer is an optional capability of a publisher that remembers what
// it sent (exactly-once into Kafka): Sent reports whether e is in the
// broker already, committed by this relay or an earlier one, as the
// source's Unsettled allows. The relay asks before it hands an event off
// (HandOffer): such an event counts as published, not handed off to be
// published again.
type Committer interface {
	Sent(ctx context.Context, e *Event) (bool, error)
}

// PermanentError marks a publish failure that retrying cannot fix: a message
// too large, a type with no route, a message the broker rejects.
type PermanentError struct{ Err error }

func (e *PermanentError) Error() string { return "permanent: " + e.Err.Error() }

func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent wraps err so the relay holds the event for an operator instead of
// retrying it. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err}
}

// IsPermanent reports whether err, or an error it wraps, is permanent.
func IsPermanent(err error) bool {
	var p *PermanentError
	return errors.As(err, &p)
}

// UndeliverableError marks a transient publish failure the broker itself
// reported: it is up, but nothing receives the event now (RabbitMQ returned
// it: no queue is bound). The event is retried with RetryBackoff like any
// transient failure, but the relay does not back off as from a broker that
// is down, which would hold back every other event.
type UndeliverableError struct{ Err error }

func (e *UndeliverableError) Error() string { return e.Err.Error() }

func (e *UndeliverableError) Unwrap() error { return e.Err }

// Undeliverable wraps err as an UndeliverableError. Undeliverable(nil) is
// nil.
func Undeliverable(err error) error {
	if err == nil {
		return nil
	}
	return &UndeliverableError{Err: err}
}

// IsUndeliverable reports whether err, or an error it wraps, is
// undeliverable.
func IsUndeliverable(err error) bool {
	var u *UndeliverableError
	return errors.As(err, &u)
}
