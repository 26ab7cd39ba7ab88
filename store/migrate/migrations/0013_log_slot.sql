-- A log-only write must succeed only when the outbox's own slot will
-- decode it. Migration 9 accepted any pgoutput slot of the database with
-- a publication naming the table: another application's slot, the
-- temporary slot of a creation that can still fail, an invalidated slot.
-- The slot and publication the outbox reads are recorded here, one row,
-- by `outbox slot create` once the slot is made (and by the log relay
-- when it starts reading it), and removed by `outbox slot drop`.
-- confirmed_lsn is the relay's last confirmed position, written soon
-- after each confirmation: the server saves a slot's confirmed position
-- to disk only now and then, and after a crash its slot would go back to
-- the last save and send again what the relay had already published. The
-- relay resumes from the later of the two.

--- step
CREATE TABLE IF NOT EXISTS {{.LogSlot}} (
    one         boolean PRIMARY KEY DEFAULT true CHECK (one),
    slot_name   text NOT NULL,
    publication text NOT NULL,
    confirmed_lsn pg_lsn
);

-- The write emits a producer's message only when the recorded slot is a
-- permanent pgoutput slot of this database, not invalidated (wal_status
-- lost, which every invalidation shows; and not conflicting, on the
-- servers that have the column, which the branch names only there), and
-- the recorded publication publishes the table's inserts; else it raises
-- in the producer's transaction. The check runs once per transaction: a
-- transaction-local setting remembers it.
CREATE OR REPLACE FUNCTION {{.LogWriteFunc}}(message text) RETURNS void LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    ready boolean;
BEGIN
    IF current_setting('outbox.log_slot_checked', true) IS DISTINCT FROM {{.LogPrefixLiteral}} THEN
        ready := EXISTS (SELECT 1 FROM {{.LogSlot}} o
                         JOIN pg_replication_slots s ON s.slot_name = o.slot_name
                         WHERE s.slot_type = 'logical' AND s.plugin = 'pgoutput' AND s.database = current_database()
                           AND NOT s.temporary AND s.confirmed_flush_lsn IS NOT NULL
                           AND s.wal_status IS DISTINCT FROM 'lost'
                           AND EXISTS (SELECT 1 FROM pg_publication p JOIN pg_publication_tables t ON t.pubname = p.pubname
                                       WHERE p.pubname = o.publication AND p.pubinsert
                                         AND t.schemaname = {{.SchemaLiteral}} AND t.tablename = {{.TableLiteral}}));
        IF ready AND current_setting('server_version_num')::int >= 160000 THEN
            -- PL/pgSQL resolves a statement's columns when it first runs
            -- it: older servers never see this one.
            ready := NOT EXISTS (SELECT 1 FROM {{.LogSlot}} o JOIN pg_replication_slots s ON s.slot_name = o.slot_name
                                 WHERE s.conflicting);
        END IF;
        IF NOT ready THEN
            RAISE EXCEPTION 'outbox log write: no replication slot of this outbox reads log-only events, so this event would be lost'
                USING ERRCODE = 'object_not_in_prerequisite_state',
                      HINT = 'Create the slot and publication (outbox slot create, or start the log relay once), or write rows to the table. '
                             'A slot that is invalidated must be recreated (outbox slot drop, outbox slot create).';
        END IF;
        PERFORM set_config('outbox.log_slot_checked', {{.LogPrefixLiteral}}, true);
    END IF;
    PERFORM pg_logical_emit_message(true, {{.LogPrefixLiteral}}, message);
END
$$;
