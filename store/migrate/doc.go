// Package migrate creates and upgrades an outbox's tables: Migrate applies
// the migrations a schema does not have yet, step by step while producers
// go on writing; Migrations lists them for review or for a DBA to apply
// (see `outbox migrate --print`); CheckSchema tells a relay whether the
// schema is ready; Grants and ApplyGrants give the relay, producer and
// consumer roles the least privileges each needs.
package migrate
