-- The log relay (relay.mode log) publishes events it reads from a logical
-- replication slot. An event it cannot publish (a permanent broker
-- rejection) and every later event of that aggregate are handed to the
-- table path instead: handoff_at says when. Rows the log relay publishes
-- itself, and every row in table mode, keep it NULL.

--- step
ALTER TABLE {{.Outbox}} ADD COLUMN handoff_at TIMESTAMPTZ;

-- The rows the table path of log mode claims: the view keeps the table's
-- columns, so the ordinary claim, mark and gate run on it unchanged, and
-- it is updatable, so they lock and update the table's rows. SELECT *
-- is expanded when the view is created: it has the columns of migration 7
-- (payload_bytes, content_type, topic, deliver_at). A later migration that
-- adds, drops or retypes a column of the table must drop and recreate
-- this view, or the table path would not see the change.
CREATE VIEW {{.HandoffView}} AS
    SELECT * FROM {{.Outbox}} WHERE handoff_at IS NOT NULL;

--- step concurrently
-- Pending handed-off rows, usually few: the log relay asks, per event of
-- an aggregate it handed over, whether that aggregate still has some.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {{.HandoffIdx}} ON {{.Outbox}} (aggregate_id, seq)
    WHERE handoff_at IS NOT NULL AND dispatched_at IS NULL AND parked_at IS NULL;
