-- Log-only events (relay.mode log) are logical messages, not rows: one
-- written while no slot reads this database is in no slot's stream and is
-- lost. The write function emits a producer's message only when a
-- pgoutput slot of this database is ready (its creation has finished, so
-- it decodes every transaction that writes after this check) and a
-- publication names the table (`outbox slot create` makes both; the
-- catalog is read directly, the pg_publication_tables view costs more);
-- else it
-- raises in the producer's transaction. The check runs once per
-- transaction: a transaction-local setting remembers it.

--- step
CREATE FUNCTION {{.LogWriteFunc}}(message text) RETURNS void LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF current_setting('outbox.log_slot_checked', true) IS DISTINCT FROM {{.LogPrefixLiteral}} THEN
        IF NOT EXISTS (SELECT 1 FROM pg_replication_slots
                       WHERE slot_type = 'logical' AND plugin = 'pgoutput' AND database = current_database()
                         AND confirmed_flush_lsn IS NOT NULL)
           OR NOT EXISTS (SELECT 1 FROM pg_publication_rel r
                          JOIN pg_class c ON c.oid = r.prrelid JOIN pg_namespace n ON n.oid = c.relnamespace
                          WHERE n.nspname = {{.SchemaLiteral}} AND c.relname = {{.TableLiteral}}) THEN
            RAISE EXCEPTION 'outbox log write: no replication slot reads log-only events of this database yet, so this event would be lost'
                USING ERRCODE = 'object_not_in_prerequisite_state',
                      HINT = 'Create the slot and publication first (outbox slot create, or start the log relay once), or write rows to the table.';
        END IF;
        PERFORM set_config('outbox.log_slot_checked', {{.LogPrefixLiteral}}, true);
    END IF;
    PERFORM pg_logical_emit_message(true, {{.LogPrefixLiteral}}, message);
END
$$;
