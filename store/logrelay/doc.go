// Package logrelay is the log source, a sibling of the table source: it
// reads committed events from a PostgreSQL logical replication slot (the
// pgoutput plugin, through github.com/jackc/pglogrepl) instead of claiming
// them from the outbox table, and runs core's engine over them, which
// publishes them in commit order per aggregate, with no help from the
// producers; log-only events never touch the table at all. This package
// decodes the stream, manages the slot and confirms positions; lanes,
// retries and hand-offs are core's.
//
// It reads two kinds of event from one stream:
//
//   - inserts into the outbox table, from a publication on it (table + log:
//     producers write rows as in table mode, and the relay marks each row
//     dispatched once published);
//   - logical decoding messages of the outbox's prefix, which producers
//     write with outbox.LogWriter or the outbox's log write function (log
//     only: no row at all; the write is refused while no slot would read
//     it; package core/event defines the message format).
//
// The slot's confirmed position advances only past transactions all of
// whose events the broker acknowledged (and whose rows are marked), so a
// crash at any point republishes and never skips. An event the broker
// rejects permanently is handed to the table, held with its reason; later
// events of its aggregate follow it there, and the table path, a
// core.Relay over the table source on the outbox's handoff view,
// publishes them once an operator retries or parks it. One relay holds
// the slot; others stand by and take over when its connection ends. A log
// relay refuses to start while a table-mode relay runs on the same outbox,
// and the other way round (store.ErrMixedModes): both would publish every
// row.
//
// # Main types
//
//   - [Pair] is log mode whole, as `outbox relay --mode log` runs it: a
//     [Relay] reading the slot and, beside it, the table relay that
//     publishes what the log relay hands to the table. A service that
//     embeds log mode runs a Pair; [NewPair] takes the table source over
//     the handoff view, which table.NewHandOff builds.
//   - [Relay] is the log relay alone: [New], then [Relay.Run] in each
//     replica. [Relay.Ready] serves a readiness probe.
//   - [Options] names the outbox (store.Config), the [Slot] and its
//     publication, and embeds core.Options for the engine; the zero value
//     is valid. A field out of range is a *core.OptionError.
//   - [CreateSlot], [DropSlot] and [Inspect] (a [SlotStatus]) manage the
//     slot and the publication, as `outbox slot` does; a relay creates
//     them itself unless [Options].ManualSlot is set. [Check] and
//     [FailoverWarnings] tell what the server and the role lack.
//
// Run returns an error only for what retrying cannot fix; it wraps
// [ErrSlotLost], [ErrNotPublished], [ErrPublicationFiltered],
// [ErrSlotOfOtherDatabase], [ErrNoSlot] (with ManualSlot, or still missing
// once created) or
// store.ErrMixedModes. A relay that finds the slot held stands by
// ([ErrSlotBusy] is never returned by Run).
//
// # Example
//
//	opts := logrelay.Options{Store: store.Config{Schema: "public", Table: "events_outbox"}}
//	handoff, err := table.NewHandOff(pool, opts.Store, logger) // the table source over the handoff view
//	if err != nil {
//		return err
//	}
//	pair, err := logrelay.NewPair(pool, pub, opts, handoff, core.Options{Logger: logger})
//	if err != nil {
//		return err
//	}
//	return pair.Run(ctx) // until ctx ends; then both relays drain and confirm
//
// The pool must connect directly to the primary (not through PgBouncer),
// as a role with the REPLICATION attribute, to a server with
// wal_level=logical.
//
// # Where next
//
// docs/design.md ("The log relay") explains the stream, the hand-offs and
// the confirmed position; docs/operations.md ("Log mode: slot,
// publication and WAL safety") the slot's care, its metrics and alerts;
// docs/producers.md ("Log mode") the producers' side. Package store/table
// is the table source the table path runs on, and package core the
// engine both relays run.
package logrelay
