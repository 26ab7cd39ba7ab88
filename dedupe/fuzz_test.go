package dedupe_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/core/event"
	"github.com/outboxhq/outbox/dedupe"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// FuzzEventID checks that EventID either returns the header exactly, as an
// identity PostgreSQL stores, or an error wrapping ErrNoEventID. With a test
// database it also records each accepted identity: one EventID accepts but
// the insert refuses would be redelivered forever.
func FuzzEventID(f *testing.F) {
	f.Add("0199a1b2-3c4d-7e5f-8a9b-0c1d2e3f4a5b", true)
	f.Add("", true)
	f.Add("", false)
	f.Add(" padded ", true)
	f.Add("nul\x00inside", true)
	f.Add("\xff\xfe", true)
	f.Add(strings.Repeat("x", dedupe.MaxEventIDBytes), true)

	var d *dedupe.Deduper[pgx.Tx]
	if os.Getenv(pgtest.EnvURL) != "" {
		pool, cfg := pgtest.Schema(f)
		var err error
		if d, err = dedupe.New(pool, dedupe.Options{Consumer: "fuzz", Store: cfg}); err != nil {
			f.Fatal(err)
		}
	}

	f.Fuzz(func(t *testing.T, value string, present bool) {
		msg := message.NewMessage("message-uuid", nil)
		if present {
			msg.Metadata.Set(event.HeaderEventID, value)
		}
		id, err := dedupe.EventID(msg)
		if err != nil {
			if !errors.Is(err, dedupe.ErrNoEventID) {
				t.Fatalf("error %v does not wrap ErrNoEventID", err)
			}
			if id != "" {
				t.Fatalf("id %q returned with an error", id)
			}
			if !utf8.ValidString(err.Error()) {
				t.Fatalf("error message is not valid UTF-8: %q", err.Error())
			}
			return
		}
		switch {
		case !present:
			t.Fatal("an identity was returned for a message without the header")
		case id != value:
			t.Fatalf("id %q differs from the header %q", id, value)
		case id == "" || len(id) > dedupe.MaxEventIDBytes || !utf8.ValidString(id):
			t.Fatalf("accepted a malformed id %q", id)
		}
		if d == nil {
			return
		}
		if _, err := d.Process(context.Background(), id, func(context.Context, pgx.Tx) error { return nil }); err != nil {
			t.Fatalf("accepted id %q cannot be recorded: %v", id, err)
		}
	})
}
