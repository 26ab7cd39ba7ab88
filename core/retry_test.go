package core_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/outboxhq/outbox/core"
)

func TestRetryBacksOffAndResets(t *testing.T) {
	// With Min 1ns the n-th wait is between 2^(n-1) and 2^n ns: which
	// attempt a wait followed shows in its size.
	b := core.Backoff{Min: 1, Max: time.Microsecond}
	calls := 0
	var waits []time.Duration
	err := b.Retry(context.Background(), func(reset func()) error {
		calls++
		switch calls {
		case 4:
			reset() // a session that connected, then failed
		case 5:
			return nil
		}
		return errors.New("down")
	}, func(err error, wait time.Duration) { waits = append(waits, wait) })
	if err != nil || calls != 5 {
		t.Fatalf("Retry = %v after %d calls, want nil after 5", err, calls)
	}
	if len(waits) != 4 || waits[0] != 1 || waits[2] < 2 || waits[2] > 4 || waits[3] != 1 {
		t.Fatalf("waits %v, want 1, 1-2, 2-4, then 1 after the reset", waits)
	}
}

func TestRetryStopsWithItsContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	failures := 0
	err := core.Backoff{Min: time.Hour, Max: time.Hour}.Retry(ctx, func(func()) error {
		return errors.New("down")
	}, func(error, time.Duration) {
		failures++
		cancel() // during the hour's wait
	})
	if !errors.Is(err, context.Canceled) || failures != 1 {
		t.Fatalf("Retry = %v after %d failures, want context.Canceled after 1", err, failures)
	}
	err = core.Backoff{Min: 1, Max: 1}.Retry(ctx, func(func()) error { return errors.New("down") },
		func(error, time.Duration) { t.Error("failed heard a failure after ctx ended") })
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Retry on an ended ctx = %v", err)
	}
}

func TestOptionErrorNamesTheField(t *testing.T) {
	_, err := core.Options{BatchSize: -1}.WithDefaults()
	var oe *core.OptionError
	if !errors.As(err, &oe) || oe.Field != "BatchSize" {
		t.Fatalf("WithDefaults = %v, want an *OptionError for BatchSize", err)
	}
	if want := "relay options: BatchSize is invalid, want 0 (the default) to 10000"; err.Error() != want {
		t.Fatalf("error %q, want %q", err, want)
	}
}

// Every field out of range is named, so a config file's errors come at once.
func TestOptionErrorsNameEveryField(t *testing.T) {
	_, err := core.Options{BatchSize: -1, Lanes: -1, PollInterval: -1}.WithDefaults()
	var fields []string
	for _, err := range err.(interface{ Unwrap() []error }).Unwrap() {
		var oe *core.OptionError
		if errors.As(err, &oe) {
			fields = append(fields, oe.Field)
		}
	}
	if got := strings.Join(fields, " "); got != "BatchSize Lanes PollInterval" {
		t.Fatalf("fields named: %q, want BatchSize Lanes PollInterval (error: %v)", got, err)
	}
}
