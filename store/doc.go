// Package store holds what the outbox's PostgreSQL parts share: the
// Config that names an outbox's tables, the producer's Insert, the
// consumer dedupe table's statements (Processed), a stored row as the
// sources read it (Row), the backlog counts, the hand-off notice and the
// lock that keeps table mode and log mode apart.
//
// The parts themselves are its subpackages: the table source
// (store/table), the log source (store/logrelay), the schema's
// migrations (store/migrate) and the operator queries (store/admin).
package store
