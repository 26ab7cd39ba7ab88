-- Parked events, usually few, for `outbox stuck --parked` and unpark
-- without a scan of the whole table. New rows are never parked, so
-- producers add no entry to it.
CREATE INDEX ON {{.Outbox}} (id) WHERE parked_at IS NOT NULL;
