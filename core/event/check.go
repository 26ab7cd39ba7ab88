package event

import (
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/google/uuid"
)

// FieldError says which field of an event breaks a rule. Msg is the
// whole explanation and starts with the field's name, as in
// `topic "a b" contains whitespace or a control character`.
type FieldError struct {
	// Field is "aggregate_id", "type", "content_type", "topic",
	// "deliver_at", "headers", "payload" or "event_id".
	Field string
	Msg   string
}

func (e *FieldError) Error() string { return e.Msg }

func fieldError(field, format string, a ...any) *FieldError {
	return &FieldError{Field: field, Msg: field + " " + fmt.Sprintf(format, a...)}
}

// CheckKey refuses an aggregate key the table refuses: empty, longer than
// MaxKeyBytes, not UTF-8, or with a control character. Keys are otherwise
// opaque and compared byte for byte. Like the other Check functions, the
// error is a phrase to follow the field's name.
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

// CheckType refuses a type a broker route or header cannot carry: empty,
// longer than MaxTypeBytes, or with whitespace or control characters.
func CheckType(t string) error {
	switch {
	case t == "":
		return errors.New("is empty")
	case len(t) > MaxTypeBytes:
		return fmt.Errorf("is %d bytes, over the limit of %d", len(t), MaxTypeBytes)
	case !utf8.ValidString(t):
		return errors.New("is not valid UTF-8")
	case strings.IndexFunc(t, spaceOrControl) >= 0:
		return fmt.Errorf("%q contains whitespace or a control character", t)
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
	case strings.IndexFunc(t, spaceOrControl) >= 0:
		return errors.New("contains whitespace or a control character")
	}
	return nil
}

func spaceOrControl(r rune) bool { return unicode.IsSpace(r) || unicode.IsControl(r) }

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

// CheckDeliverAt refuses a deliver-at time PostgreSQL cannot store as a
// finite timestamptz.
func CheckDeliverAt(t time.Time) error {
	if t.Year() < -4712 || t.Year() > 294275 {
		return fmt.Errorf("%s is out of PostgreSQL's range", t.Format(time.RFC3339))
	}
	return nil
}

// ErrNotUUID is wrapped by ParseID's error for an id that is not a UUID.
var ErrNotUUID = errors.New("not a UUID")

// ParseID reads an event id: a UUID in any form uuid.Parse accepts,
// returned in its canonical form. The error wraps ErrNotUUID.
func ParseID(id string) (string, error) {
	u, err := uuid.Parse(id)
	if err != nil {
		return "", fmt.Errorf("%q is %w", Short(id), ErrNotUUID)
	}
	return u.String(), nil
}

// CheckFields applies the rules of an event's key, type, content type,
// topic and deliver-at time. Its id, headers and payload each source
// checks with ParseID, EncodeHeaders and CheckPayload, as it holds them.
// The error is a *FieldError.
func CheckFields(aggregateID, typ, contentType, topic string, deliverAt time.Time) error {
	if err := CheckKey(aggregateID); err != nil {
		return fieldError("aggregate_id", "%s", err)
	}
	if err := CheckType(typ); err != nil {
		return fieldError("type", "%s", err)
	}
	if contentType != "" {
		if err := CheckContentType(contentType); err != nil {
			return fieldError("content_type", "%q %s", Short(contentType), err)
		}
	}
	if topic != "" {
		if err := CheckTopic(topic); err != nil {
			return fieldError("topic", "%q %s", Short(topic), err)
		}
	}
	if !deliverAt.IsZero() {
		if err := CheckDeliverAt(deliverAt); err != nil {
			return fieldError("deliver_at", "%s", err)
		}
	}
	return nil
}

// EncodeHeaders checks an event's headers and returns them as JSON, nil
// for none. It refuses empty names, names the relay sets itself, invalid
// UTF-8 and NUL characters (jsonb cannot hold them), and more than
// MaxHeadersBytes as JSON. The error is a *FieldError.
func EncodeHeaders(h map[string]string) ([]byte, error) {
	if len(h) == 0 {
		return nil, nil
	}
	for k, v := range h {
		switch {
		case k == "":
			return nil, &FieldError{Field: "headers", Msg: "headers have an empty name"}
		case slices.Contains(ReservedHeaders, k):
			return nil, &FieldError{Field: "headers", Msg: fmt.Sprintf("headers: header name %q is set by the relay", k)}
		case !utf8.ValidString(k) || !utf8.ValidString(v) || strings.ContainsRune(k+v, 0):
			return nil, &FieldError{Field: "headers", Msg: fmt.Sprintf("headers: header %q is not valid UTF-8 or has a NUL character", Short(k))}
		}
	}
	b, err := json.Marshal(h)
	if err != nil {
		return nil, fieldError("headers", "cannot be serialized: %v", err)
	}
	if len(b) > MaxHeadersBytes {
		return nil, fieldError("headers", "are %d bytes as JSON, over the limit of %d", len(b), MaxHeadersBytes)
	}
	return b, nil
}

// CheckPayload refuses a payload over maxBytes, and for a JSON content
// type (IsJSON) one that is not valid JSON in UTF-8. Any other content
// type's payload is bytes: an empty one is a payload too. The error is a
// *FieldError.
func CheckPayload(contentType string, p []byte, maxBytes int) error {
	switch {
	case len(p) > maxBytes:
		return fieldError("payload", "is %d bytes, over the limit of %d", len(p), maxBytes)
	case !IsJSON(contentType):
		return nil
	case !json.Valid(p):
		return fieldError("payload", "is not valid JSON")
	case !utf8.Valid(p):
		return fieldError("payload", "is not valid UTF-8")
	}
	return nil
}

// Short cuts s for an error message: at most 64 bytes, then "...", with
// invalid UTF-8 replaced.
func Short(s string) string {
	if len(s) > 64 {
		s = s[:64] + "..."
	}
	return strings.ToValidUTF8(s, "?")
}
