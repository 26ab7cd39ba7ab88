// Command outbox runs the transactional outbox relay and its operator
// commands. See `outbox --help`.
package main

import (
	"context"
	"os"

	_ "github.com/outboxhq/outbox/brokers/amqp"
	_ "github.com/outboxhq/outbox/brokers/gochannel"
	_ "github.com/outboxhq/outbox/brokers/googlecloud"
	_ "github.com/outboxhq/outbox/brokers/kafka"
	_ "github.com/outboxhq/outbox/brokers/stdout"
	"github.com/outboxhq/outbox/cmd/outbox/outboxcli"
)

func main() {
	os.Exit(outboxcli.Main(context.Background(), os.Args[1:]))
}
