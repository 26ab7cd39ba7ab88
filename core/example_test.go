package core_test

import (
	"context"
	"fmt"
	"time"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/memsource"
)

// printer is a Publisher that prints what it publishes.
type printer struct{ published chan struct{} }

func (p printer) Publish(ctx context.Context, e *core.Event) error {
	fmt.Printf("%s %s %s\n", e.AggregateID, e.Type, e.Payload)
	p.published <- struct{}{}
	return nil
}

func (printer) Close() error { return nil }

func Example() {
	s := memsource.New()
	s.Add(
		core.Event{AggregateID: "order-1", Type: "order.placed", Payload: []byte(`{"total":42}`)},
		core.Event{AggregateID: "order-1", Type: "order.paid", Payload: []byte(`{}`)},
	)
	pub := printer{published: make(chan struct{}, 2)}
	relay, err := core.New(s, pub, core.Options{PollInterval: 10 * time.Millisecond})
	if err != nil {
		fmt.Println(err)
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- relay.Run(ctx) }()

	<-pub.published
	<-pub.published
	cancel() // Run finishes the batch in flight, then returns
	if err := <-done; err != nil {
		fmt.Println(err)
	}
	fmt.Println("pending:", len(s.Pending()))
	// Output:
	// order-1 order.placed {"total":42}
	// order-1 order.paid {}
	// pending: 0
}

// Retry calls a function until it succeeds, waiting longer after each
// failure in a row; reset starts the count over.
func ExampleBackoff_Retry() {
	attempts := 0
	err := core.Backoff{Min: time.Millisecond, Max: 10 * time.Millisecond}.Retry(context.Background(),
		func(reset func()) error {
			attempts++
			if attempts < 3 {
				return fmt.Errorf("attempt %d: connection refused", attempts)
			}
			return nil
		},
		func(err error, wait time.Duration) { fmt.Println(err) })
	fmt.Println("attempts:", attempts, "error:", err)
	// Output:
	// attempt 1: connection refused
	// attempt 2: connection refused
	// attempts: 3 error: <nil>
}
