package store

import (
	"fmt"
	"time"

	"github.com/outboxhq/outbox/core/event"
)

// The rules of an event's fields live in package event, which every
// producer and both relay sources share; these names stay for callers of
// this package. Migration 7 states the limits again as the table's checks
// and in its write function.
const (
	MaxKeyBytes         = event.MaxKeyBytes
	MaxTypeBytes        = event.MaxTypeBytes
	MaxTopicBytes       = event.MaxTopicBytes
	MaxContentTypeBytes = event.MaxContentTypeBytes
	MaxHeadersBytes     = event.MaxHeadersBytes
)

// ReservedHeaders are the header names the relay sets on every message;
// producers may not set them (the table refuses them too).
var ReservedHeaders = event.ReservedHeaders

// CheckKey is event.CheckKey.
func CheckKey(k string) error { return event.CheckKey(k) }

// CheckTopic is event.CheckTopic.
func CheckTopic(t string) error { return event.CheckTopic(t) }

// CheckContentType is event.CheckContentType.
func CheckContentType(ct string) error { return event.CheckContentType(ct) }

// CheckDeliverAt is event.CheckDeliverAt.
func CheckDeliverAt(t time.Time) error { return event.CheckDeliverAt(t) }

// IsJSON is event.IsJSON.
func IsJSON(ct string) bool { return event.IsJSON(ct) }

// CheckType is event.CheckType, with the error naming the field ("type is
// empty"), as it always has.
func CheckType(t string) error {
	if err := event.CheckType(t); err != nil {
		return fmt.Errorf("type %w", err)
	}
	return nil
}
