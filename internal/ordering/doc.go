// Package ordering holds integration tests of the relay against a real
// PostgreSQL: per-aggregate order with several relay replicas that are
// killed and restarted while producers write, the unordered mode as a
// negative control, events that cannot be published (held, retried,
// parked), and the drain measurements quoted in docs/design.md.
//
// The tests need OUTBOX_TEST_DATABASE_URL (`make test` starts a server).
// OUTBOX_ORDERING_EVENTS sets the size of the multi-replica run (10000 by
// default); OUTBOX_DRAIN_EVENTS enables the drain measurements, with
// OUTBOX_DRAIN_AGGREGATES, OUTBOX_DRAIN_CASES, OUTBOX_DRAIN_REPEAT and
// OUTBOX_DRAIN_POLL to vary them (see drain_test.go).
package ordering
