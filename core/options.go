package core

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"time"
)

// Options configure a Relay. The zero value is valid: every unset field
// takes the default named in its comment.
type Options struct {
	BatchSize int // events per claim; default 500, at most MaxBatchSize
	// Lanes is how many events are published at once, across the open
	// claims; in ordered mode each aggregate has one at a time. A broker
	// that answers each publish on its own (Kafka, Pub/Sub) goes as fast
	// as the publishes in flight allow, so this is the setting to raise
	// for it. Default 256, at most MaxLanes.
	Lanes int
	// Claimers is how many claims (batches) may be open at once: while one
	// is published, the next is claimed and the last is recorded. Each open
	// claim holds a database transaction and connection until its every
	// event is resolved; claims that hand off (HandOffer) hold none and
	// are not counted. A relay that shares the ordered work with others
	// (Sharer) opens its share of them, at least one, and all of them while
	// a batch has been open for over a second. Default 4, at most
	// MaxClaimers.
	Claimers       int
	PollInterval   time.Duration // wait after a short batch; default 1s (wake-ups usually come first)
	PublishTimeout time.Duration // bound on one publish; default 30s
	// ShutdownTimeout bounds how long Run waits for the publishes in
	// flight after its context is cancelled; default 30s.
	ShutdownTimeout time.Duration
	// Unordered lets events of one aggregate go out in parallel and
	// out of order, for throughput. The default keeps per-aggregate order.
	Unordered bool
	// DisableWakeups ignores the source's Notifier and relies on polling,
	// as behind PgBouncer in transaction pooling mode.
	DisableWakeups bool
	// DisableSharing ignores the source's Sharer in ordered mode: the
	// relay claims from all of the source's work, still disjoint and in
	// order, but in the way of the other replicas. Set it where the
	// source's sharing cannot work, as behind PgBouncer in transaction
	// pooling mode, which does not keep session locks.
	DisableSharing bool
	// RetryBackoff paces retries of an event whose publish failed
	// transiently; default 500ms doubling to 1m.
	RetryBackoff Backoff
	// ErrorBackoff paces the loop after a claim, complete or whole-batch
	// failure (database or broker down); default 100ms doubling to 30s.
	ErrorBackoff Backoff
	// HandOffAfter applies to sources whose claims hand events off (see
	// HandOffer): a transiently failing event is retried in place, holding
	// its aggregate back, and handed off after this many failures if other
	// events were published meanwhile or the publisher answers its ping.
	// A broker that takes nothing is an outage: the event stays in place
	// and reading pauses. Default 8; -1 never hands off.
	HandOffAfter int
	// ProbeInterval is how often the relay pings the source and the
	// publisher (those that implement Pinger) while it backs off after a
	// failure. Once a ping has failed, the first round in which every ping
	// succeeds ends the wait: the outage is over, so the relay resumes at
	// once instead of sleeping out a backoff grown during it. Default
	// 250ms; each ping is bounded by ProbeTimeout (default 2s).
	ProbeInterval time.Duration
	ProbeTimeout  time.Duration
	// StaleAfter is how long the relay may go without completing a cycle
	// before Ready reports it; default 2 x PublishTimeout (a batch whose
	// publishes time out, then its record) plus 3 x PollInterval, and at
	// least 30s.
	StaleAfter time.Duration
	Logger     *slog.Logger // default: discard
	Observer   Observer     // default: none
}

// Upper bounds of the relay's sizes: past them a relay holds more
// connections, goroutines or memory than any gain pays for.
const (
	MaxBatchSize = 10000
	MaxLanes     = 1024
	MaxClaimers  = 64
)

// WithDefaults returns o with every unset field at its default, or an
// error naming the first field out of range. New calls it; a program
// mapping its own configuration onto Options can call it to show the
// effective values.
func (o Options) WithDefaults() (Options, error) {
	// A Backoff is either unset (the default) or has 0 < Min <= Max: with
	// a zero Min every retry would come at once.
	badBackoff := func(b Backoff) bool { return b != (Backoff{}) && (b.Min <= 0 || b.Max < b.Min) }
	err := CheckOptions("relay options",
		OptionCheck{"BatchSize", fmt.Sprintf("0 (the default) to %d", MaxBatchSize), o.BatchSize < 0 || o.BatchSize > MaxBatchSize},
		OptionCheck{"Lanes", fmt.Sprintf("0 (the default) to %d", MaxLanes), o.Lanes < 0 || o.Lanes > MaxLanes},
		OptionCheck{"Claimers", fmt.Sprintf("0 (the default) to %d", MaxClaimers), o.Claimers < 0 || o.Claimers > MaxClaimers},
		OptionCheck{"PollInterval", "not negative", o.PollInterval < 0},
		OptionCheck{"PublishTimeout", "not negative", o.PublishTimeout < 0},
		OptionCheck{"ShutdownTimeout", "not negative", o.ShutdownTimeout < 0},
		OptionCheck{"ProbeInterval", "not negative", o.ProbeInterval < 0},
		OptionCheck{"ProbeTimeout", "not negative", o.ProbeTimeout < 0},
		OptionCheck{"StaleAfter", "not negative", o.StaleAfter < 0},
		OptionCheck{"RetryBackoff", "unset or 0 < Min <= Max", badBackoff(o.RetryBackoff)},
		OptionCheck{"ErrorBackoff", "unset or 0 < Min <= Max", badBackoff(o.ErrorBackoff)},
		OptionCheck{"HandOffAfter", "-1 (never), 0 (the default) or more", o.HandOffAfter < -1},
	)
	if err != nil {
		return o, err
	}
	o.BatchSize = cmp.Or(o.BatchSize, 500)
	o.Lanes = cmp.Or(o.Lanes, 256)
	o.Claimers = cmp.Or(o.Claimers, 4)
	o.HandOffAfter = cmp.Or(o.HandOffAfter, 8)
	o.PollInterval = cmp.Or(o.PollInterval, time.Second)
	o.PublishTimeout = cmp.Or(o.PublishTimeout, 30*time.Second)
	o.ShutdownTimeout = cmp.Or(o.ShutdownTimeout, 30*time.Second)
	o.ProbeInterval = cmp.Or(o.ProbeInterval, 250*time.Millisecond)
	o.ProbeTimeout = cmp.Or(o.ProbeTimeout, 2*time.Second)
	o.StaleAfter = cmp.Or(o.StaleAfter, max(2*o.PublishTimeout+3*o.PollInterval, 30*time.Second))
	o.RetryBackoff = cmp.Or(o.RetryBackoff, Backoff{Min: 500 * time.Millisecond, Max: time.Minute})
	o.ErrorBackoff = cmp.Or(o.ErrorBackoff, Backoff{Min: 100 * time.Millisecond, Max: 30 * time.Second})
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Observer == nil {
		o.Observer = nopObserver{}
	}
	return o, nil
}

// OptionError names an option out of range. Its text is
// "<Options>: <Field> is invalid, want <Want>", as in
// "relay options: BatchSize is invalid, want 0 (the default) to 10000".
type OptionError struct {
	Options string // whose options, such as "relay options"
	Field   string // the field's name in its Go struct, such as "BatchSize"
	Want    string // the values it takes
}

func (e *OptionError) Error() string {
	return e.Options + ": " + e.Field + " is invalid, want " + e.Want
}

// OptionCheck is one range check of an options struct, for CheckOptions.
type OptionCheck struct {
	Field, Want string
	Bad         bool // the field is out of range
}

// CheckOptions returns an *OptionError for each bad check, joined with
// errors.Join, or nil; options names whose options they are.
// Options.WithDefaults uses it, and so can a source's own options.
func CheckOptions(options string, checks ...OptionCheck) error {
	var errs []error
	for _, c := range checks {
		if c.Bad {
			errs = append(errs, &OptionError{Options: options, Field: c.Field, Want: c.Want})
		}
	}
	return errors.Join(errs...)
}
