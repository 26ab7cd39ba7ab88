package event_test

import (
	"errors"
	"testing"

	"github.com/google/uuid"

	"github.com/outboxhq/outbox/core/event"
)

// ParseID accepts and rewrites what uuid.Parse, which read ids before it,
// accepts and prints.
func FuzzParseID(f *testing.F) {
	for _, s := range []string{
		"0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0d", "0190A7F4-8C3E-7B2A-9D41-5E6F7A8B9C0D",
		"urn:uuid:0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0d", "URN:UUID:0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0d",
		"{0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0d}", "x0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0dy",
		"0190a7f48c3e7b2a9d415e6f7a8b9c0d", "0190a7f4+8c3e-7b2a-9d41-5e6f7a8b9c0d",
		"urn:uuix:0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0d", "0190a7f4-8c3e-7b2a-9d41-5e6f7a8b9c0g",
		"", "abc", "0190a7f48c3e7b2a9d415e6f7a8b9c0", "{0190a7f48c3e7b2a9d415e6f7a8b9c0d}",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got, err := event.ParseID(s)
		u, uerr := uuid.Parse(s)
		switch {
		case (err == nil) != (uerr == nil):
			t.Fatalf("ParseID(%q) = %q, %v; uuid.Parse: %v", s, got, err, uerr)
		case err == nil && got != u.String():
			t.Fatalf("ParseID(%q) = %q, want %q", s, got, u.String())
		case err != nil && !errors.Is(err, event.ErrNotUUID):
			t.Fatalf("ParseID(%q) error %v does not wrap ErrNotUUID", s, err)
		}
	})
}
