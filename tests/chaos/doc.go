// Package chaos is the reliability suite: producers write events, some in
// transactions that roll back, while several `outbox relay` processes
// publish them to a real broker and a checker consumes them through the
// deduplicating consumer. Meanwhile relays are killed and paused, and the
// broker and PostgreSQL are stopped and started. The run ends with an
// accounting: committed, delivered, lost, phantom, order violations,
// duplicates and effects applied twice.
//
// The servers are the run's own (scripts/services.sh, on loopback), so the
// faults touch nothing else. `make chaos` runs the full version
// (cmd/chaos); the test in this package is the short one.
package chaos
