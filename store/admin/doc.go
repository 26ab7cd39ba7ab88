// Package admin holds the operator queries on an outbox: the listings
// behind `outbox stuck`, `outbox status` and the console (Events, Event,
// Failures, Activity, Status, Stuck), the commands that act on events
// (Retry, Park, Unpark, Replay, chosen by a Selector) and the retention
// (Cleanup, RunRetention). An Admin, made by New, runs them over a
// pgxpool.Pool; it claims nothing and runs beside the relays. An argument
// it refuses is an error wrapping ErrInvalid.
package admin
