package table

import (
	"fmt"
	"strings"
)

// Candidates carry every column the relay needs, so no statement reads a
// row twice, and their size, so no oversized payload leaves the server.
const claimCols = "seq, event_id::text AS event_id, aggregate_id, type, payload, payload_bytes, content_type, topic, headers, created_at, attempts, replays," +
	" coalesce(octet_length(payload::text), octet_length(payload_bytes)) + coalesce(octet_length(headers::text), 0) AS size"

const claimPending = `dispatched_at IS NULL AND parked_at IS NULL AND (retry_at IS NULL OR retry_at <= now())`

// claimStillPending is claimPending for looking up rows by seq. Written so
// that it proves none of the partial indexes' predicates, it leaves the
// primary key as the only index to find them by: statistics that say
// nothing is pending once made the planner read a whole partial index
// for the claim's few hundred seqs instead.
const claimStillPending = `coalesce(dispatched_at, parked_at) IS NULL AND (retry_at IS NULL OR retry_at <= now())`

// The result sends a row's payload only when the row fits the event limit
// ($2) and the claim's running total of fitting rows stays within the
// claim limit ($3). An oversized row comes back without its payload, to be
// held; rows past the claim limit come back with within = false and stay
// pending. The first fitting row is always within, so a claim makes
// progress whatever the limits.
const (
	claimWithin  = `(w.total <= $3 OR w.total = c.size)`
	claimRunning = `SELECT seq, sum(CASE WHEN size <= $2 THEN size ELSE 0 END) OVER (ORDER BY seq) AS total FROM cand`
)

// claimResult is the claim's columns; gate, when set, is a condition (and
// AND) a row must meet for its payload to be sent.
func claimResult(gate string) string {
	return `c.seq, c.event_id, c.aggregate_id::text, c.type,
       CASE WHEN ` + gate + `c.size <= $2 AND ` + claimWithin + ` THEN c.payload::text END,
       CASE WHEN ` + gate + `c.size <= $2 AND ` + claimWithin + ` THEN c.payload_bytes END,
       c.content_type, c.topic, c.headers::text, c.created_at, c.attempts, c.replays, c.size, ` + claimWithin + `,
       ` + unitOf("c.")
}

// unitOf is the partition of the row whose columns have prefix p, as an
// event's unit (core.Settler): computed for the rows a claim returns only,
// it leaves the plan as it was.
func unitOf(p string) string {
	return "(hashtext(" + p + "aggregate_id) & 31)"
}

// orderedClaim is the ordered claim over partitions parts, or over every
// partition when parts is nil.
//
// It reads the first $1 pending events in seq order, merging each
// partition's from the partition index, and leaves out two kinds: the
// caller's own in flight ($4: events of its open claims, which it
// publishes first), and the events of an aggregate from its first event
// that is not due yet (waiting for a retry or its deliver-at time) on, or
// from its first event on for the aggregates the caller holds back ($5).
// held has that seq per aggregate, usually few; both sets are hashed, so
// an event the scan steps over costs two lookups. Then it locks what it
// read, skipping rows another session holds: another relay's claim, or one
// of the caller's own whose publish failed. Such a row holds its
// aggregate back from there on: the aggregate's events after it are
// returned as not passing, and stay pending. Every earlier pending event
// of an aggregate lies earlier in the same scan, so an event passes only
// when each one before it is in the claim or in flight. Nothing is looked
// up per aggregate, however hot one is. At most $1 events pass.
//
// The rows it could not lock come back too, as not passing, with their
// seq and aggregate only: the caller learns which aggregates locked rows
// hold back, and that the claim was cut short.
func (s *Source) orderedClaim(parts []int) string {
	if parts != nil && len(parts) == 0 {
		return ""
	}
	scan := func(cond string) string {
		return `(SELECT seq, aggregate_id FROM ` + s.n.Outbox + `
        WHERE ` + cond + claimPending + ` AND seq NOT IN (SELECT seq FROM mine)
          AND (aggregate_id NOT IN (SELECT aggregate_id FROM held)
               OR (seq < (SELECT max(seq) FROM held)
                   AND seq < ((SELECT jsonb_object_agg(aggregate_id, seq) FROM held) ->> aggregate_id)::bigint))
        ORDER BY seq LIMIT $1)`
	}
	var scans []string
	if parts == nil {
		scans = []string{scan("")}
	}
	for _, p := range parts {
		scans = append(scans, scan(fmt.Sprintf("%s = %d AND ", partitionOf, p)))
	}
	return `
WITH held AS MATERIALIZED (
    SELECT aggregate_id, min(seq) AS seq FROM (
        SELECT aggregate_id, seq FROM ` + s.n.Outbox + `
        WHERE dispatched_at IS NULL AND parked_at IS NULL AND retry_at IS NOT NULL AND retry_at > now()
        UNION ALL SELECT unnest($5::text[]), 0
    ) h
    GROUP BY aggregate_id
), mine AS MATERIALIZED (
    SELECT unnest($4::bigint[]) AS seq
), pre AS MATERIALIZED (
    SELECT seq, aggregate_id FROM (
        ` + strings.Join(scans, "\n        UNION ALL ") + `
    ) u
    ORDER BY seq
    LIMIT $1
), cand AS MATERIALIZED (
    SELECT ` + claimCols + ` FROM ` + s.n.Outbox + `
    WHERE seq = ANY (ARRAY(SELECT seq FROM pre)) AND ` + claimStillPending + `
    ORDER BY seq
    FOR UPDATE SKIP LOCKED
), skipped AS MATERIALIZED (
    SELECT seq, aggregate_id FROM pre
    WHERE seq NOT IN (SELECT seq FROM cand)
), gate AS (
    SELECT c.seq, c.size, s.seq IS NULL OR c.seq < s.seq AS passes
    FROM cand c LEFT JOIN (SELECT aggregate_id, min(seq) AS seq FROM skipped GROUP BY aggregate_id) s
        ON s.aggregate_id = c.aggregate_id
), w AS (
    SELECT seq, passes, sum(CASE WHEN passes AND size <= $2 THEN size ELSE 0 END) OVER (ORDER BY seq) AS total
    FROM gate
)
SELECT ` + claimResult("w.passes AND ") + `, w.passes
FROM cand c JOIN w ON w.seq = c.seq
UNION ALL
SELECT seq, '', aggregate_id, '', NULL, NULL, NULL, NULL, NULL, now(), 0, 0, 0, false, 0, false
FROM skipped
ORDER BY 1`
}
