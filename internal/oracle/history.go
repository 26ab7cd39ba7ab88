// Package oracle checks the relay against a reference model of the
// project's promises. A History is a sequence of steps (producer
// transactions, relay stops and kills, operator actions); the tests in this
// package run generated histories against the real relays and PostgreSQL,
// and Sim says, from the history and what the database reports (which
// transactions committed, in which order), what the broker must and must
// not have received.
package oracle

import (
	"fmt"
	"strings"
	"time"
)

// Mode is a way of running the relay.
type Mode int

const (
	TableOrdered   Mode = iota // table mode, ordered claims (the default)
	TableUnordered             // table mode, relay.unordered
	LogRows                    // log mode, events written as rows ("table+log")
	LogOnly                    // log mode, log-only events (logical decoding messages)
)

// Modes lists every mode.
var Modes = []Mode{TableOrdered, TableUnordered, LogRows, LogOnly}

func (m Mode) String() string {
	return [...]string{"table-ordered", "table-unordered", "log-rows", "log-only"}[m]
}

// Ordered says whether the mode promises per-aggregate order.
func (m Mode) Ordered() bool { return m != TableUnordered }

// Log says whether the mode reads a replication slot.
func (m Mode) Log() bool { return m == LogRows || m == LogOnly }

// Path is the way a history's relays publish, and where the broker's
// record comes from.
type Path int

const (
	// InProcess is the in-process broker: it records each publish it
	// takes and fails the events it is told to.
	InProcess Path = iota
	// Kafka is the plain Kafka publisher into an in-process Kafka
	// cluster; the record is what a consumer reads from the events'
	// topic, partition by partition in offset order.
	Kafka
	// ExactlyOnce is the transactional Kafka publisher
	// (brokers.kafka.exactly_once) into an in-process Kafka cluster; the
	// record is what a read_committed consumer reads. Besides the other
	// promises, no event may be delivered twice but by a replay. Only
	// the ordered modes support it.
	ExactlyOnce
)

func (p Path) String() string {
	return [...]string{"in-process", "kafka", "exactly-once"}[p]
}

// Suffix is what the path adds to a mode's name ("table-ordered-eos").
func (p Path) Suffix() string {
	return [...]string{"", "-kafka", "-eos"}[p]
}

// Kafka says whether the path publishes into a Kafka cluster.
func (p Path) Kafka() bool { return p != InProcess }

// Producer is how an event is written.
type Producer int

const (
	GoRows    Producer = iota // outbox.Writer
	SQLFunc                   // the SQL write function
	SQLInsert                 // a plain INSERT
	GoLog                     // outbox.LogWriter
	// SQLLogWrite is the SQL log write function (migration 9), the
	// documented way to write a log-only event from SQL. A raw
	// pg_logical_emit_message is not a producer here: it skips the
	// function's check that a slot reads the event, so before the slot
	// exists its event is lost, which nothing promises otherwise.
	SQLLogWrite
)

func (p Producer) String() string {
	return [...]string{"writer", "sql-function", "sql-insert", "log-writer", "sql-log-write"}[p]
}

// Row says whether the producer writes a row (else a log-only message).
func (p Producer) Row() bool { return p <= SQLInsert }

// Sched is an event's deliver-at time.
type Sched int

const (
	Now  Sched = iota // no deliver-at time
	Soon              // due within the run (SoonDelay after the write)
	Far               // due long after the run: it must wait throughout
)

// SoonDelay is how far ahead a Soon event is scheduled, and FarDelay a Far one.
const (
	SoonDelay = 1200 * time.Millisecond
	FarDelay  = time.Hour
)

// Fault is what goes wrong with an event.
type Fault int

const (
	None      Fault = iota
	Transient       // the broker fails its first publishes, then takes it
	Permanent       // the broker refuses it permanently until an operator retries it
	Bad             // written by SQL over the relay's event size limit: held for good
)

// EventSpec is one event a transaction writes. N is its label, unique in
// the history; the payload carries it.
type EventSpec struct {
	N        int
	Key      int // aggregate k<Key>
	Producer Producer
	Sched    Sched
	Fault    Fault
}

func (e EventSpec) String() string {
	s := fmt.Sprintf("k%d#%d %s", e.Key, e.N, e.Producer)
	switch e.Sched {
	case Soon:
		s += " deliver_at+" + SoonDelay.String()
	case Far:
		s += " deliver_at+" + FarDelay.String()
	}
	switch e.Fault {
	case Transient:
		s += " fails-transiently"
	case Permanent:
		s += " fails-permanently"
	case Bad:
		s += " bad-row"
	}
	return s
}

// Tx is one producer transaction.
type Tx struct {
	Events   []EventSpec
	Lock     bool // the producer locks the aggregates first (pg_advisory_xact_lock)
	Rollback bool
}

func (t Tx) String() string {
	parts := make([]string, len(t.Events))
	for i, e := range t.Events {
		parts[i] = e.String()
	}
	s := "tx"
	if t.Lock {
		s += "[lock]"
	}
	s += " {" + strings.Join(parts, "; ") + "}"
	if t.Rollback {
		s += " ROLLBACK"
	}
	return s
}

// StepKind is what a step does.
type StepKind int

const (
	Write           StepKind = iota // Txs run concurrently (one or more)
	StopRelay                       // graceful stop
	StartRelay                      // start (a no-op while running)
	KillRelay                       // its sessions terminated, then stopped without waiting; started again
	RestartPostgres                 // a crash of the server (immediate shutdown) and a start (long runs only)
	Retry                           // operator retry of event Target
	Park                            // operator park of event Target
	Unpark                          // operator unpark of event Target
	Replay                          // operator replay of event Target
	// FailProduce: the Kafka cluster fails its next produce requests to
	// the events' topic (Kafka paths only; Target is how many). In a
	// transaction the records already produced are then aborted.
	FailProduce
	// FailCommit: the Kafka cluster refuses the next transaction
	// commits (exactly-once only; Target is how many), before applying
	// them: the publisher cannot tell whether its transaction committed.
	FailCommit
	// Takeover starts a second relay beside the running one, lets both
	// run a moment, then kills the first (Kafka paths only): the units of
	// ownership move to the newcomer while the old owner still publishes.
	Takeover
)

// Step is one step of a history.
type Step struct {
	Kind   StepKind
	Txs    []Tx
	Target int // the event label an operator action names
}

func (s Step) String() string {
	switch s.Kind {
	case Write:
		parts := make([]string, len(s.Txs))
		for i, t := range s.Txs {
			parts[i] = t.String()
		}
		if len(parts) == 1 {
			return "write " + parts[0]
		}
		return "concurrently " + strings.Join(parts, " | ")
	case StopRelay:
		return "stop relay"
	case StartRelay:
		return "start relay"
	case KillRelay:
		return "kill relay, start it again"
	case RestartPostgres:
		return "restart PostgreSQL"
	case Retry:
		return fmt.Sprintf("retry #%d", s.Target)
	case Park:
		return fmt.Sprintf("park #%d", s.Target)
	case Unpark:
		return fmt.Sprintf("unpark #%d", s.Target)
	case Replay:
		return fmt.Sprintf("replay #%d", s.Target)
	case FailProduce:
		if s.Target == 3 {
			return "kafka takes the next produce request and answers it timed out"
		}
		return fmt.Sprintf("kafka fails the next %d produce request(s)", s.Target)
	case FailCommit:
		return fmt.Sprintf("kafka fails the next %d transaction commit(s)", s.Target)
	case Takeover:
		return "start a second relay beside it, then kill the first"
	}
	return fmt.Sprintf("step kind %d", s.Kind)
}

// Operator says whether the step is an operator action: the system is
// let settle before it, so the action meets a known state.
func (s Step) Operator() bool {
	switch s.Kind {
	case Retry, Park, Unpark, Replay:
		return true
	}
	return false
}

// History is what one run does, from a relay that is running (unless
// StartStopped) over a fresh outbox.
type History struct {
	Mode Mode
	Path Path
	Seed uint64
	// StartStopped starts with the relay stopped: in log modes the slot
	// then does not exist until the first StartRelay.
	StartStopped bool
	Steps        []Step
}

func (h History) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "mode %s%s, seed %d", h.Mode, h.Path.Suffix(), h.Seed)
	if h.StartStopped {
		b.WriteString(", relay stopped at first")
	}
	b.WriteString(":\n")
	for i, s := range h.Steps {
		fmt.Fprintf(&b, "  %2d. %s\n", i+1, s)
	}
	b.WriteString("  (then the relay runs, the system settles and the record is checked)")
	return b.String()
}

// Events returns every event the history writes, by label.
func (h History) Events() map[int]EventSpec {
	out := map[int]EventSpec{}
	for _, s := range h.Steps {
		for _, t := range s.Txs {
			for _, e := range t.Events {
				out[e.N] = e
			}
		}
	}
	return out
}

// Normalize drops operator steps naming events the history no longer
// writes before them and empty writes: what shrinking leaves behind.
func (h History) Normalize() History {
	written := map[int]bool{}
	var steps []Step
	for _, s := range h.Steps {
		switch {
		case s.Kind == Write:
			var txs []Tx
			for _, t := range s.Txs {
				if len(t.Events) > 0 {
					txs = append(txs, t)
					for _, e := range t.Events {
						written[e.N] = true
					}
				}
			}
			if len(txs) == 0 {
				continue
			}
			s.Txs = txs
		case s.Operator() && !written[s.Target]:
			continue
		}
		steps = append(steps, s)
	}
	h.Steps = steps
	return h
}
