// Package core is the relay engine of the outbox: it claims committed events
// from a Store, publishes them through a Publisher and records the outcome.
//
// The package owns the two small interfaces it consumes and imports no
// database or broker library, so the engine can be tested with the in-memory
// store in package internal/memsource and driven by any storage or broker adapter.
//
// Two sources run on it: the outbox table (package store), whose claims
// leave an unpublished event pending to be offered again, and the
// replication stream (package store/logrelay), whose claims cannot offer
// an event again and hand it off instead (HandOffer). Optional
// capabilities of a Store (Notifier, Sleeper, Pinger, BacklogReader) and
// of a Claim (Truncated, Rejecter, HandOffer) add what a source can do.
//
// Delivery is at-least-once: an event is marked dispatched only after its
// publish returned nil, and a crash between the two republishes it.
// In ordered mode (the default) all events of one aggregate are published one
// after another in id order, on one lane, even with many relays running.
package core
