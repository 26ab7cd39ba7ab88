package logrelay_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store/logrelay"
)

// Options out of range are refused with the field named, before a relay
// can run with them.
func TestOptionsNameTheFieldOutOfRange(t *testing.T) {
	cases := []struct {
		field string
		set   func(o *logrelay.Options)
	}{
		{"Lanes", func(o *logrelay.Options) { o.Lanes = core.MaxLanes + 1 }},
		{"BatchSize", func(o *logrelay.Options) { o.BatchSize = -1 }},
		{"Unordered", func(o *logrelay.Options) { o.Unordered = true }},
		{"HandOffAfter", func(o *logrelay.Options) { o.HandOffAfter = -2 }},
		{"RetryBackoff", func(o *logrelay.Options) { o.RetryBackoff = core.Backoff{Min: time.Second, Max: time.Millisecond} }},
		{"ReceiveTimeout", func(o *logrelay.Options) { o.StatusInterval, o.ReceiveTimeout = 5*time.Second, 5*time.Second }},
		// A status slower than the server's timeout would lose the session
		// whenever the relay reads nothing (back-pressure, a drain).
		{"WALSenderTimeout", func(o *logrelay.Options) { o.StatusInterval, o.WALSenderTimeout = 3*time.Second, 2*time.Second }},
	}
	for _, c := range cases {
		t.Run(c.field, func(t *testing.T) {
			var o logrelay.Options
			c.set(&o)
			_, err := o.WithDefaults()
			if err == nil || !strings.Contains(err.Error(), c.field) {
				t.Fatalf("error %v, want one naming %s", err, c.field)
			}
		})
	}
	if _, err := (logrelay.Options{WALSenderTimeout: -1, StatusInterval: time.Minute, ReceiveTimeout: 2 * time.Minute}).WithDefaults(); err != nil {
		t.Fatalf("the server's own wal_sender_timeout with a slow status: %v", err)
	}
}

// What both relays have (lanes, timeouts, backoffs) defaults to the table
// relay's value, stated once in core, so the two modes of one binary agree.
func TestOptionsShareTheTableRelaysDefaults(t *testing.T) {
	lr, err := logrelay.Options{}.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	tr, err := core.Options{}.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name      string
		log, tabl any
	}{
		{"Lanes", lr.Lanes, tr.Lanes},
		{"PublishTimeout", lr.PublishTimeout, tr.PublishTimeout},
		{"ShutdownTimeout", lr.ShutdownTimeout, tr.ShutdownTimeout},
		{"RetryBackoff", lr.RetryBackoff, tr.RetryBackoff},
		{"ErrorBackoff", lr.ErrorBackoff, tr.ErrorBackoff},
	} {
		if c.log != c.tabl {
			t.Errorf("%s: log relay %v, table relay %v", c.name, c.log, c.tabl)
		}
	}
}

// The log relay's own fields out of range are a *core.OptionError, as
// core's are, with the text they always had, so that a caller (the
// binary) can name its own key for the field.
func TestOptionsOutOfRangeAreOptionErrors(t *testing.T) {
	for _, c := range []struct {
		o     logrelay.Options
		field string
		text  string
	}{
		{logrelay.Options{MaxInFlight: -1}, "MaxInFlight", "log relay options: MaxInFlight is invalid, want not negative"},
		{logrelay.Options{ReceiveTimeout: -time.Second}, "ReceiveTimeout", "log relay options: ReceiveTimeout is invalid, want not negative"},
		{logrelay.Options{Options: core.Options{Unordered: true}}, "Unordered",
			"log relay options: Unordered is invalid, want false: the log relay keeps each aggregate's order"},
	} {
		_, err := c.o.WithDefaults()
		var oe *core.OptionError
		if !errors.As(err, &oe) || oe.Field != c.field || err.Error() != c.text {
			t.Errorf("%s out of range: %v, want a *core.OptionError %q", c.field, err, c.text)
		}
	}
}
