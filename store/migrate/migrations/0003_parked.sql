-- Parked events, usually few, for `outbox stuck --parked` and unpark
-- without a scan of the whole table. New rows are never parked, so
-- producers add no entry to it. Built concurrently, as migration 2's.

--- step concurrently
CREATE INDEX CONCURRENTLY IF NOT EXISTS {{.ParkedIdx}} ON {{.Outbox}} (id) WHERE parked_at IS NOT NULL;
