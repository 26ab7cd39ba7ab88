package logrelay

import (
	"github.com/outboxhq/outbox/core/event"
	"github.com/outboxhq/outbox/store"
)

// The log message format lives in package event, which producers link
// without this package; these names stay for callers of this one.

// MessageVersion is event.MessageVersion.
const MessageVersion = event.MessageVersion

// Message is event.Message: one event as a log-only producer emits it.
type Message = event.Message

// EncodeError names the field of a Message the encoding cannot carry; it
// is event.FieldError.
type EncodeError = event.FieldError

// EncodeMessage is event.EncodeMessage.
func EncodeMessage(m Message) ([]byte, error) { return event.EncodeMessage(m) }

// DecodeMessage is event.DecodeMessage.
func DecodeMessage(content []byte) (Message, error) { return event.DecodeMessage(content) }

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
