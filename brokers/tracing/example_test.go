package tracing_test

import (
	"context"
	"fmt"
	"os"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/outboxhq/outbox/brokers/stdout"
	"github.com/outboxhq/outbox/brokers/tracing"
	"github.com/outboxhq/outbox/core"
)

// Wrap the broker's publisher before giving it to the relay; leave it
// unwrapped to keep tracing off.
func ExampleWrap() {
	tp := sdktrace.NewTracerProvider() // with an exporter of your choice
	defer tp.Shutdown(context.Background())
	var broker core.Publisher = stdout.New(os.Stdout, nil)
	pub, err := tracing.Wrap(broker, tracing.Options{TracerProvider: tp, System: "stdout"})
	if err != nil {
		panic(err)
	}
	_ = pub // core.New(store, pub, opts)
	fmt.Println("wrapped")
	// Output: wrapped
}
