// Package store is the PostgreSQL side of the outbox, on pgx v5: versioned
// schema migrations, the relay's claiming (FOR UPDATE SKIP LOCKED, with the
// per-aggregate gate of ordered mode), LISTEN/NOTIFY wake-ups and the
// operator queries behind the admin commands.
//
// A Store implements core.Source, core.Notifier, core.Pinger and
// core.BacklogReader.
package store
