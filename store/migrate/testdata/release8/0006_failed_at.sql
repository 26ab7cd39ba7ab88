-- When the last publish attempt of an event failed, for the operator
-- console: failures grouped by error with first and last seen, and failures
-- per minute. A column without a default is added without rewriting the
-- table.
ALTER TABLE {{.Outbox}} ADD COLUMN failed_at TIMESTAMPTZ;

-- Failed events only: an insert by a producer (failed_at NULL) adds no
-- entry, and the failure update of the relay already changes indexed columns.
CREATE INDEX {{.FailedIdx}} ON {{.Outbox}} (failed_at) WHERE failed_at IS NOT NULL;
