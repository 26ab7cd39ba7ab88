// Package logrelay is the log source: it reads committed events from a
// PostgreSQL logical replication slot (the pgoutput plugin, through
// github.com/jackc/pglogrepl) instead of claiming them from the outbox
// table, and runs core's engine over them, which publishes them in commit
// order per aggregate. This package decodes the stream, manages the slot
// and confirms positions; lanes, retries and hand-offs are core's.
//
// It reads two kinds of event from one stream:
//
//   - inserts into the outbox table, from a publication on it (table + log:
//     producers write rows as in table mode, and the relay marks each row
//     dispatched once published);
//   - logical decoding messages of the outbox's prefix, which producers
//     write with the outbox's log write function (log only: no row at
//     all; it refuses the write while no slot would read it; see
//     event.EncodeMessage for the format and outbox.LogWriter for the
//     writer).
//
// The slot's confirmed position advances only past transactions all of
// whose events the broker acknowledged (and whose rows are marked), so a
// crash at any point republishes and never skips. An event the broker
// rejects permanently is handed to the table, held with its reason; later
// events of its aggregate follow it there, and the table path (a
// core.Relay over the store's handoff view, see HandOffConfig) publishes
// them once an operator retries or parks it. One relay holds the slot;
// others wait and take over when its connection ends.
package logrelay
