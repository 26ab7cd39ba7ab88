-- Retention finds old dispatched events through this index instead of a
-- scan of the whole table. It is partial, so the producer's insert (with
-- dispatched_at still NULL) adds no entry to it; the relay's mark already
-- changes dispatched_at, an indexed column, so it was never a HOT update
-- and now writes one more index entry. Built concurrently: the table may
-- be large by now, and writes go on while it is built. The name is the one
-- PostgreSQL chose when this migration left it to choose.

--- step concurrently
CREATE INDEX CONCURRENTLY IF NOT EXISTS {{.DispatchedIdx}} ON {{.Outbox}} (dispatched_at) WHERE dispatched_at IS NOT NULL;
