package event_test

import (
	"errors"
	"fmt"
	"time"

	"github.com/outboxhq/outbox/core/event"
)

// A producer checks an event's fields before it writes the event; the
// error names the field at fault.
func ExampleCheckFields() {
	err := event.CheckFields("order-1", "order placed", "", "", time.Time{})
	var fe *event.FieldError
	if errors.As(err, &fe) {
		fmt.Println(fe.Field+":", err)
	}
	// Output:
	// type: type "order placed" contains whitespace or a control character
}

// ParseID takes a UUID in any of its usual forms and returns it in the
// canonical one.
func ExampleParseID() {
	id, err := event.ParseID("{0190A7F4-8C3E-7B2A-9D41-5E6F7A8B9C0D}")
	fmt.Println(id, err)
	_, err = event.ParseID("order-1")
	fmt.Println(err, errors.Is(err, event.ErrNotUUID))
	// Output:
	// 0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0d <nil>
	// "order-1" is not a UUID true
}
