package dedupe

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/outboxhq/outbox/core/event"
)

// ErrNoEventID is wrapped by the errors of EventID, and by the middleware's
// error for a message it rejects under the Reject policy: match it in a
// poison queue filter with errors.Is.
var ErrNoEventID = errors.New("no usable event identity")

// MaxEventIDBytes bounds an event identity; the relay's are 36-byte UUIDs.
const MaxEventIDBytes = 200

// EventID returns the event identity the relay put in msg's metadata
// (header event.HeaderEventID). A missing, empty, over-long or malformed
// value is an error wrapping ErrNoEventID. The message UUID is not used as
// a fallback: a publisher other than the relay may generate a new one for
// every send, which would make duplicates look new.
//
// Header event.HeaderEventUID wins when present: relays before migration 5
// sent the identity there and the row position in event_id, and later
// relays send both with the same value, so a message relayed again after
// an upgrade keeps its key.
func EventID(msg *message.Message) (string, error) {
	if msg == nil {
		return "", fmt.Errorf("%w: message is nil", ErrNoEventID)
	}
	name := event.HeaderEventUID
	id, ok := msg.Metadata[name]
	if !ok {
		name = event.HeaderEventID
		if id, ok = msg.Metadata[name]; !ok {
			return "", fmt.Errorf("%w: header %q is missing", ErrNoEventID, event.HeaderEventID)
		}
	}
	if err := checkEventID(id); err != nil {
		return "", fmt.Errorf("header %q: %w", name, err)
	}
	return id, nil
}

func checkEventID(id string) error {
	switch {
	case id == "":
		return fmt.Errorf("%w: it is empty", ErrNoEventID)
	case len(id) > MaxEventIDBytes:
		return fmt.Errorf("%w: it is %d bytes, over the limit of %d", ErrNoEventID, len(id), MaxEventIDBytes)
	case !utf8.ValidString(id):
		return fmt.Errorf("%w: it is not valid UTF-8", ErrNoEventID)
	case strings.ContainsFunc(id, unicode.IsControl) || strings.TrimSpace(id) != id:
		return fmt.Errorf("%w: %q has control characters or surrounding spaces", ErrNoEventID, id)
	}
	return nil
}

// Middleware is a Watermill handler middleware: router.AddMiddleware(d.Middleware).
// It runs h at most once per event for this consumer, in a transaction set
// in the message context (TxFromContext), and commits when h succeeds. A
// duplicate is acknowledged without calling h. When h returns an error or
// panics, the transaction rolls back, the dedupe record included, and the
// error or panic goes on to the router, which nacks for a redelivery.
//
// Messages h returns are handed to the router after the commit, to publish
// on its own: that publish is not atomic with the database, and a crash
// between the two loses them. Writing the next event with outbox.Writer on
// the transaction instead commits it together with the handler's effects.
func (d *Deduper[T]) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		id, idErr := EventID(msg)
		if _, ok := d.active(ctx, id); ok {
			return h(msg) // an inner wrapper of the same deduper
		}
		record := true
		if idErr != nil {
			d.log.ErrorContext(ctx, "message without event identity",
				"message_uuid", msg.UUID,
				"handler", message.HandlerNameFromCtx(ctx),
				"topic", message.SubscribeTopicFromCtx(ctx),
				"policy", d.opts.MissingID.String(),
				"error", idErr)
			if d.opts.MissingID == Reject {
				return nil, fmt.Errorf("dedupe message %s: %w", msg.UUID, idErr)
			}
			record = false
		}
		var out []*message.Message
		applied, err := d.run(ctx, id, record, func(txCtx context.Context, _ T) error {
			msg.SetContext(txCtx)
			defer msg.SetContext(ctx)
			var err error
			out, err = h(msg)
			return err
		})
		if err != nil {
			return nil, err
		}
		if !applied {
			d.log.DebugContext(ctx, "skipped duplicate event", "event_id", id, "message_uuid", msg.UUID)
			return nil, nil
		}
		return out, nil
	}
}

// HandlerFunc handles one message in the dedupe transaction tx.
type HandlerFunc[T any] func(ctx context.Context, tx T, msg *message.Message) ([]*message.Message, error)

// NoPublishHandlerFunc handles one message in the dedupe transaction tx and
// produces no messages.
type NoPublishHandlerFunc[T any] func(ctx context.Context, tx T, msg *message.Message) error

// Handler adapts fn to a Watermill handler deduplicated as by Middleware,
// passing it the transaction. It may also sit behind Middleware of the same
// Deduper, and then shares its transaction.
func (d *Deduper[T]) Handler(fn HandlerFunc[T]) message.HandlerFunc {
	return d.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := TxFromContext[T](msg.Context())
		return fn(msg.Context(), tx, msg)
	})
}

// NoPublishHandler is Handler for router.AddConsumerHandler.
func (d *Deduper[T]) NoPublishHandler(fn NoPublishHandlerFunc[T]) message.NoPublishHandlerFunc {
	h := d.Handler(func(ctx context.Context, tx T, msg *message.Message) ([]*message.Message, error) {
		return nil, fn(ctx, tx, msg)
	})
	return func(msg *message.Message) error {
		_, err := h(msg)
		return err
	}
}
