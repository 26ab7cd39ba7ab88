-- Producers wake a relay only while one sleeps. PostgreSQL serializes
-- notifying commits (it holds a database-wide lock from queueing the
-- notification until the commit is flushed), so a NOTIFY on every commit
-- caps producers at about one commit per WAL flush. A relay about to wait
-- for wake-ups takes an advisory lock on the table's key (store.Sleep);
-- a producer notifies only when it cannot take that key shared. One that
-- can holds it shared until its commit, so a relay going to sleep first
-- waits for that commit and then claims what it wrote. Replacing the
-- function takes no lock on the table.

--- step
CREATE OR REPLACE FUNCTION {{.NotifyFunc}}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock_shared(hashtextextended('outbox-wake:' || TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME, 0)) THEN
        PERFORM pg_notify(TG_ARGV[0], '');
    END IF;
    RETURN NULL;
END
$$;
