// Package event holds the rules of an outbox event that every producer and
// both relay sources share: what its fields may hold and how large they
// may be, the format of the message a log-only producer emits into the
// write-ahead log, and the check a relay applies to a stored row before
// publishing it. outbox.Writer and outbox.LogWriter apply the rules to what
// a producer writes, the table source (package store) to the rows it
// claims, and the log source (package store/walrelay) to the rows and
// messages it reads, so all of them accept and refuse the same events.
//
// It lives at the module root, beside the writer, rather than under store,
// because it is not about PostgreSQL: it imports only the standard library,
// google/uuid and core's definitions (core imports nothing but the
// standard library), so a producer links the rules without the log relay
// (store/walrelay) and pglogrepl. Limits that are configurable (the writer's
// payload limit, the relay's event limit) are passed in by the caller,
// which keeps their defaults.
//
// Migration 7 states the same rules again as the table's checks and in
// its SQL write function, for producers that do not use Go.
package event

import "github.com/outboxhq/outbox/core"

// Header names the relay sets on every published message (core defines
// them, as the relay's contract with consumers). Producers may not set
// them (ReservedHeaders).
const (
	HeaderEventID     = core.HeaderEventID
	HeaderEventSeq    = core.HeaderEventSeq
	HeaderType        = core.HeaderType
	HeaderAggregateID = core.HeaderAggregateID
	HeaderContentType = core.HeaderContentType
	HeaderEventUID    = core.HeaderEventUID
)

// ReservedHeaders are the header names the relay sets on every message;
// producers may not set them (the table refuses them too).
var ReservedHeaders = []string{
	HeaderEventID, HeaderEventSeq, HeaderEventUID,
	HeaderType, HeaderAggregateID, HeaderContentType,
}

// Limits of an event's parts that every producer and the relay share.
const (
	// MaxKeyBytes bounds an aggregate key: room for any UUID, number or
	// composite id, and under Pub/Sub's 1 KB ordering key.
	MaxKeyBytes = 255
	// MaxTypeBytes bounds an event type.
	MaxTypeBytes = 255
	// MaxTopicBytes bounds a topic named on the event; Kafka allows 249
	// characters, AMQP 255 bytes, Pub/Sub 255.
	MaxTopicBytes = 255
	// MaxContentTypeBytes bounds a content type.
	MaxContentTypeBytes = 255
	// MaxHeadersBytes bounds the headers as JSON; AMQP sends headers in
	// one frame.
	MaxHeadersBytes = 64 << 10
)

// IsJSON reports whether content type ct is JSON (core.IsJSON): empty
// (the default, application/json), application/json, or any type ending
// in +json, with or without parameters.
func IsJSON(ct string) bool { return core.IsJSON(ct) }
