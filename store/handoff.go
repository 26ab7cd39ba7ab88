package store

// The hand-off notice: a command that makes rows pending again (replay,
// retry, unpark) tells the log relay, in commit order, which aggregates it
// handed to the table path.

// HandOffPrefix is the prefix of the logical message a command that hands
// rows off emits (see HandingOff): the outbox's own, so each log relay
// reads only its table's.
func HandOffPrefix(schema, table string) string {
	return "outbox-handoff:" + schema + "." + table
}

// HandingOff wraps update, an UPDATE on n's outbox that sets handoff_at
// and returns the rows' aggregate_id and seq, into a statement that
// returns the count and the highest seq, and emits in the same
// transaction a logical message naming the aggregates it handed off. The
// log relay reads it in commit order, so every event committed after the
// command finds its aggregate handed off and follows the command's rows
// through the table; a relay that learned of it later (by polling) could
// publish such an event ahead of them. With wal_level below logical the
// message is written and never read. The third column reads n only so
// that it runs: PostgreSQL skips a WITH query nothing refers to, unless
// it modifies data.
func HandingOff(n Names, update string) string {
	return `WITH u AS (` + update + `),
n AS (SELECT pg_logical_emit_message(true, ` + n.HandOffPrefixLiteral + `, json_agg(DISTINCT aggregate_id)::text) FROM u HAVING count(*) > 0)
SELECT count(*), COALESCE(max(seq), 0), (SELECT count(*) FROM n) FROM u`
}
