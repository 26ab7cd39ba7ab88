// Package core is the relay engine of the outbox: it claims committed
// events from a Source, publishes them through a Publisher, and records
// the outcome, at least once and, by default, in order per aggregate.
//
// core links nothing but the standard library: the database is behind
// Source, the broker behind Publisher, so the engine runs the same over
// the outbox table, the replication log or the in-memory source its tests
// use.
//
// # Main types
//
//   - [Relay] runs the loop: New builds it from a Source, a Publisher and
//     [Options]; Run relays until its context ends, then stops gracefully.
//   - [Source] is where events come from. Claim hands out a [Claim]: a set
//     of [Event] values held by one relay until Complete records which
//     were published and which failed ([Failure]). Optional capabilities
//     add what a source can do: [Notifier] and [Sleeper] (wake-ups instead
//     of polling), [Sharer] (replicas divide the ordered work), [Holder]
//     (a lock held for the relay's life), [Pinger] (readiness, outage
//     probes) and [BacklogReader] (backlog gauges); a claim may be
//     [Truncated], a [Rejecter] or a [HandOffer].
//   - [Publisher] sends one event to a broker. [Permanent] marks a failure
//     no retry can fix: the relay holds the event, and only the later
//     events of its aggregate, for an operator.
//   - [Observer] hears what the relay does, for metrics (core/metrics).
//   - [Backoff] paces retries; [Backoff.Retry] is the one retry loop of the
//     engine and of the sources.
//
// # Example
//
// A relay over the outbox table (package store/table), publishing to
// Kafka (package brokers/kafka); the package's runnable example runs one
// over an in-memory source:
//
//	src, err := table.New(pool, store.Config{Schema: "app"}, logger)
//	...
//	pub, err := kafka.New(ctx, kafka.Config{Brokers: []string{"localhost:9092"}}, &brokers.Routing{}, logger)
//	...
//	relay, err := core.New(src, pub, core.Options{Logger: logger})
//	...
//	err = relay.Run(ctx) // until ctx is cancelled
//
// # Delivery
//
// Delivery is at-least-once: an event is marked dispatched only after its
// publish returned nil, and a crash between the two publishes it again;
// consumers deduplicate on the event id (package dedupe). In ordered mode
// (the default) all events of one aggregate are published one after
// another in seq order, on one lane, even with many relays running.
//
// # Where next
//
// docs/design.md explains the claim, the per-aggregate gate and the two
// sources; its section "Adding a source" is the guide to writing one, with
// the conformance suites core/claimtest and core/sourcetest. Package
// store/table is the table source, store/logrelay the log source, brokers
// the publishers, and cmd/outbox the binary that wires them from a
// configuration file.
package core
