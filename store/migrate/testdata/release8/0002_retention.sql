-- Retention finds old dispatched events through this index instead of a
-- scan of the whole table. It is partial, so the producer's insert (with
-- dispatched_at still NULL) adds no entry to it; the relay's mark already
-- changes dispatched_at, an indexed column, so it was never a HOT update
-- and now writes one more index entry.
CREATE INDEX ON {{.Outbox}} (dispatched_at) WHERE dispatched_at IS NOT NULL;
