package logrelay

import (
	"fmt"
	"time"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
	"github.com/outboxhq/outbox/store"
)

// Options configure a Relay. The zero value is valid: every unset field
// takes the default named in its comment.
type Options struct {
	Store store.Config // the outbox's names and event limits; defaults as in store.Config
	Slot  Slot         // defaults as in Slot
	// ManualSlot leaves the slot to an operator (`outbox slot create`):
	// Run fails when it is missing. By default the relay creates the
	// publication and the slot (see CreateSlot), as the binary does.
	ManualSlot bool

	// Options are the engine's, core's, with their defaults: Lanes,
	// BatchSize (events per claim from the stream, and rows marked
	// dispatched per statement), PublishTimeout, RetryBackoff (an event
	// failing transiently is retried in place, holding its aggregate and
	// the slot's position back), HandOffAfter (then it moves to the
	// table, its aggregate's later events following it, and the slot's
	// position moves past it), ErrorBackoff (also for reconnects),
	// ShutdownTimeout, Logger and Observer. Unordered is refused: the
	// log relay keeps each aggregate's order.
	core.Options

	// MaxInFlight bounds the events read from the slot and not yet done
	// (published and recorded); past it the relay stops reading, so a
	// broker outage holds memory still. Default 10000.
	MaxInFlight int
	// MaxInFlightBytes bounds their payload and header bytes the same
	// way; default 64 MiB. One event is always let in.
	MaxInFlightBytes int
	// StandbyInterval is how often a relay that waits for the slot tries
	// to take it over; default 1s.
	StandbyInterval time.Duration
	// StatusInterval is how often the relay sends its position to the
	// server and asks for a reply; an idle slot's position advances with
	// it. A position that moved is confirmed within 100ms (or this, when
	// shorter) anyway. Default 1s.
	StatusInterval time.Duration
	// ReceiveTimeout is how long the relay waits for any message from
	// the server (each status asks for one) before it counts the
	// connection as dead, drops it and its in-flight events, and starts
	// over; default 15s, more than StatusInterval.
	ReceiveTimeout time.Duration
	// WALSenderTimeout is the server's wal_sender_timeout for this
	// relay's connection: how long the server keeps the slot for a relay
	// that stopped answering (paused, cut off) before a standby can take
	// it over. Default 10s; negative keeps the server's setting
	// (PostgreSQL's default is 60s).
	WALSenderTimeout time.Duration
	// ApplicationName is the replication connection's application_name;
	// default "outbox-log-relay".
	ApplicationName string
	// HandedOff, when set, is called after the relay handed events to the
	// table path, to wake its relay (core.Relay.Wake).
	HandedOff func()
}

// optionsName names the log relay's options in their errors.
const optionsName = "log relay options"

// WithDefaults returns o with every unset field at its default, or an
// error naming the first field out of range: a *core.OptionError for a
// field of its own out of range.
func (o Options) WithDefaults() (Options, error) {
	var err error
	if o.Store, err = o.Store.WithDefaults(); err != nil {
		return o, fmt.Errorf("log relay options: %w", err)
	}
	if len(o.Store.Table)+len("_handoff") > 47 {
		return o, fmt.Errorf("log relay options: table name %q is longer than 39 bytes, too long for its handoff view", o.Store.Table)
	}
	if o.Slot, err = o.Slot.WithDefaults(o.Store); err != nil {
		return o, fmt.Errorf("log relay options: %w", err)
	}
	if err := core.CheckOptions(optionsName, core.OptionCheck{Field: "Unordered",
		Want: "false: the log relay keeps each aggregate's order", Bad: o.Unordered}); err != nil {
		return o, err
	}
	if o.Options, err = o.Options.WithDefaults(); err != nil {
		return o, fmt.Errorf("log relay options: %w", err)
	}
	err = core.CheckOptions(optionsName,
		core.OptionCheck{Field: "MaxInFlight", Want: "not negative", Bad: o.MaxInFlight < 0},
		core.OptionCheck{Field: "MaxInFlightBytes", Want: "not negative", Bad: o.MaxInFlightBytes < 0},
		core.OptionCheck{Field: "StandbyInterval", Want: "not negative", Bad: o.StandbyInterval < 0},
		core.OptionCheck{Field: "StatusInterval", Want: "not negative", Bad: o.StatusInterval < 0},
		core.OptionCheck{Field: "ReceiveTimeout", Want: "not negative", Bad: o.ReceiveTimeout < 0},
	)
	if err != nil {
		return o, err
	}
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	defDur := func(v *time.Duration, d time.Duration) {
		if *v == 0 {
			*v = d
		}
	}
	def(&o.MaxInFlight, 10000)
	def(&o.MaxInFlightBytes, 64<<20)
	defDur(&o.StandbyInterval, time.Second)
	defDur(&o.StatusInterval, time.Second)
	defDur(&o.ReceiveTimeout, 15*time.Second)
	defDur(&o.WALSenderTimeout, 10*time.Second)
	if o.ReceiveTimeout <= o.StatusInterval {
		return o, fmt.Errorf("log relay options: ReceiveTimeout %s must exceed StatusInterval %s", o.ReceiveTimeout, o.StatusInterval)
	}
	if o.WALSenderTimeout > 0 && o.WALSenderTimeout <= o.StatusInterval {
		// The server ends a session that sends no status for this long.
		return o, fmt.Errorf("log relay options: WALSenderTimeout %s must exceed StatusInterval %s", o.WALSenderTimeout, o.StatusInterval)
	}
	if o.ApplicationName == "" {
		o.ApplicationName = "outbox-log-relay"
	}
	return o, nil
}

// MessagePrefix is the logical decoding message prefix of the outbox cfg
// names (event.MessagePrefix), so several outboxes share a database and
// each relay reads only its own.
func MessagePrefix(cfg store.Config) (string, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return "", err
	}
	return event.MessagePrefix(cfg.Schema, cfg.Table), nil
}
