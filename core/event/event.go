// Package event holds the rules of an outbox event that every producer and
// both relay sources share: what its fields may hold and how large they may
// be, the headers the relay sets, the format of the message a log-only
// producer emits into the write-ahead log, and the check a relay applies to
// a stored row before publishing it. outbox.Writer and outbox.LogWriter
// apply the rules to what a producer writes, the table source
// (store/table) to the rows it claims, and the log source (store/logrelay)
// to the rows and messages it reads, so all of them accept and refuse the
// same events.
//
// The package is a leaf: it links only the standard library, so core, the
// producers and the sources all import it, and a producer links the rules
// without the log relay and its replication library.
//
// # Main names
//
//   - CheckFields, EncodeHeaders, CheckPayload and ParseID check an event
//     before it is written; their errors are a *FieldError naming the
//     field (ParseID's wraps ErrNotUUID).
//   - CheckRow is the check a relay applies to a row it claimed.
//   - Header* are the header names the relay sets on every message;
//     producers may not set them (ReservedHeaders).
//   - Max* are the limits every producer and the relay share; limits that
//     are configurable (the writer's payload limit, the relay's event
//     limit) are passed in by the caller, which keeps their defaults.
//   - LogMessage, EncodeLogMessage and DecodeLogMessage are the log-only
//     message format.
//
// Migration 7 states the same rules again as the table's checks and in its
// SQL write function, for producers that do not use Go. Where next: the
// table contract in docs/design.md, and the outbox package's Writer.
package event

import (
	"regexp"
	"strings"
)

// Header names the relay sets on every published message: the contract
// between the relay and its consumers. Producers may not set them
// (ReservedHeaders).
const (
	HeaderEventID     = "event_id"     // the event's identity, unique across outboxes; consumers dedupe on it
	HeaderEventSeq    = "event_seq"    // the event's position in its outbox table
	HeaderType        = "type"         // event type, such as "order.placed"
	HeaderAggregateID = "aggregate_id" // ordering and partition key
	HeaderContentType = "content-type" // the payload's media type; also in each broker's own place for it

	// HeaderEventUID carries the event id too, under the name releases
	// before migration 5 used, for consumers that still read it. Those
	// releases put the row position in event_id.
	HeaderEventUID = "event_uid"
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

// ContentTypeJSON is the content type of an event that names none.
const ContentTypeJSON = "application/json"

// jsonType matches the media types whose payloads are JSON.
var jsonType = regexp.MustCompile(`^(application/json|[^/]+/[^/]+\+json)$`)

// IsJSON reports whether content type ct is JSON: empty (the default,
// application/json), application/json, or any type ending in +json, with
// or without parameters. Such payloads must be valid JSON and are stored
// in the payload column; all others are bytes, passed on as they are.
func IsJSON(ct string) bool {
	if ct == "" {
		return true
	}
	mt, _, _ := strings.Cut(ct, ";")
	return jsonType.MatchString(strings.ToLower(strings.TrimSpace(mt)))
}
