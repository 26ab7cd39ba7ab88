// Package table is the table source: it relays the events producers write
// into the outbox table, claiming them in transactions that hold row locks
// (FOR UPDATE SKIP LOCKED), so any number of relays in any number of
// processes share one outbox and an event goes out again only when its
// relay died before recording it.
//
// The main type is Source, made by New over a pgxpool.Pool and the
// store.Config that names the outbox. It implements core.Source and the
// optional capabilities the engine uses when present: core.Notifier and
// core.Sleeper (LISTEN/NOTIFY wake-ups, so an idle relay publishes a
// commit at once rather than at its next poll), core.Sharer (ordered
// relays split the aggregates' 32 partitions between them), core.Pinger,
// core.BacklogReader and core.Holder (the table-mode lock: a relay refuses
// to run beside a log relay on the same outbox, which would publish every
// row a second time).
//
// In ordered mode (the default) a claim returns each aggregate's events in
// seq order and holds an aggregate back behind its first event that cannot
// go out yet (waiting for a retry, or held by a permanent failure); in
// unordered mode (core.Options.Unordered) a claim takes whatever is
// pending.
//
// A relay over the table source:
//
//	src, err := table.New(pool, store.Config{Schema: "app"}, logger)
//	if err != nil { ... }
//	relay, err := core.New(src, publisher, core.Options{Logger: logger})
//	if err != nil { ... }
//	err = relay.Run(ctx) // until ctx ends
//
// Where next: store/migrate creates the tables (migrate.Migrate) before
// the first relay starts; the package outbox at the module's root writes
// events in the producer's transaction; store/admin has the operator
// queries (stuck events, retry, park, replay, cleanup); store/logrelay is
// the other source, which reads the events from the write-ahead log; the
// engine and its options are in core.
package table
