package store

import (
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/outboxhq/outbox/core"
)

// More limits every producer shares with the relay; migration 7 states
// them again as the table's checks and in its write function.
const (
	// MaxKeyBytes bounds an aggregate key: room for any UUID, number or
	// composite id, and under Pub/Sub's 1 KB ordering key.
	MaxKeyBytes = 255
	// MaxTopicBytes bounds a topic named on the event; Kafka allows 249
	// characters, AMQP 255 bytes, Pub/Sub 255.
	MaxTopicBytes = 255
	// MaxContentTypeBytes bounds a content type.
	MaxContentTypeBytes = 255
)

// ReservedHeaders are the header names the relay sets on every message;
// producers may not set them (the table refuses them too).
var ReservedHeaders = []string{
	core.HeaderEventID, core.HeaderEventSeq, core.HeaderEventUID,
	core.HeaderType, core.HeaderAggregateID, core.HeaderContentType,
}

// CheckKey refuses an aggregate key the table refuses: empty, longer than
// MaxKeyBytes, not UTF-8, or with a control character. Keys are otherwise
// opaque and compared byte for byte.
func CheckKey(k string) error {
	switch {
	case k == "":
		return errors.New("is empty")
	case len(k) > MaxKeyBytes:
		return fmt.Errorf("is %d bytes, over the limit of %d", len(k), MaxKeyBytes)
	case !utf8.ValidString(k):
		return errors.New("is not valid UTF-8")
	case strings.IndexFunc(k, unicode.IsControl) >= 0:
		return errors.New("contains a control character")
	}
	return nil
}

// CheckTopic refuses a topic no broker can take: empty, longer than
// MaxTopicBytes, not UTF-8, or with whitespace or control characters. A
// broker may refuse more (Kafka allows only [a-zA-Z0-9._-]); it does so
// when the event is published, and the relay holds the event.
func CheckTopic(t string) error {
	switch {
	case t == "":
		return errors.New("is empty")
	case len(t) > MaxTopicBytes:
		return fmt.Errorf("is %d bytes, over the limit of %d", len(t), MaxTopicBytes)
	case !utf8.ValidString(t):
		return errors.New("is not valid UTF-8")
	case strings.IndexFunc(t, func(r rune) bool { return unicode.IsSpace(r) || unicode.IsControl(r) }) >= 0:
		return errors.New("contains whitespace or a control character")
	}
	return nil
}

// mediaType is type/subtype as RFC 6838 spells its names, then optional
// parameters. The table's check uses the same pattern.
var mediaType = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*\s*(;.*)?$`)

// CheckContentType refuses what is not a media type such as
// "application/x-protobuf" or "application/json; charset=utf-8".
func CheckContentType(ct string) error {
	switch {
	case len(ct) > MaxContentTypeBytes:
		return fmt.Errorf("is %d bytes, over the limit of %d", len(ct), MaxContentTypeBytes)
	case !utf8.ValidString(ct) || strings.IndexFunc(ct, unicode.IsControl) >= 0 || !mediaType.MatchString(ct):
		return errors.New("is not a media type such as application/x-protobuf")
	}
	return nil
}

// IsJSON reports whether content type ct is JSON; see core.IsJSON. Such
// payloads are validated and stored in the payload column; all others go
// in payload_bytes as they are.
func IsJSON(ct string) bool { return core.IsJSON(ct) }

// CheckDeliverAt refuses a deliver-at time PostgreSQL cannot store as a
// finite timestamptz.
func CheckDeliverAt(t time.Time) error {
	if t.Year() < -4712 || t.Year() > 294275 {
		return fmt.Errorf("%s is out of PostgreSQL's range", t.Format(time.RFC3339))
	}
	return nil
}
