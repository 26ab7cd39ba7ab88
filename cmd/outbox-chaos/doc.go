// Command outbox-chaos is the reliability suite: producers write events, some in
// transactions that roll back, while several `outbox relay` processes
// publish them to a real broker and a checker consumes them through the
// deduplicating consumer. Meanwhile relays are killed and paused, and the
// broker and PostgreSQL are stopped and started. The run ends with an
// accounting: committed, delivered, lost, phantom, order violations,
// duplicates and effects applied twice.
//
// The servers are the run's own (scripts/services.sh, on loopback), so the
// faults touch nothing else. `make chaos` runs the full version: by
// default 100,000 events, four relays, every fault kind repeated, against
// RabbitMQ and then Kafka, printing the accounting of each, and exits
// non-zero when an event is lost, delivered without being committed, out of
// order, or its effect applied twice. Kafka runs twice per relay mode: the
// plain publisher, then the exactly-once one (brokers.kafka.exactly_once),
// which must deliver no event twice to the checker's read_committed
// consumer; a table then gives the duplicates of each fault kind for both
// side by side. The tests in this package are the short ones.
//
//	go run ./cmd/outbox-chaos -events 20000 -brokers amqp
package main
