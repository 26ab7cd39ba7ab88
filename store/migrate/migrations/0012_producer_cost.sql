-- What a producer's INSERT pays, cut where PostgreSQL repeats work on
-- every statement (measured in docs/benchmarks.md):
--
-- The eight row checks become one, calling a PL/pgSQL function.
-- PostgreSQL rebuilds a table's check expressions for every statement
-- that writes it (it reads each back from the catalog and plans it); a
-- function keeps its compiled expressions for the session. The function
-- raises the failing rule's old constraint name (_key_check, ...), so
-- errors read as before. A row marked dispatched passes without the call,
-- so the relay's marks pay nothing. The new check is NOT VALID for good,
-- as migration 4's were: rows held for breaking those rules keep their
-- exemption, and no step scans the table.
--
-- The event id default becomes PL/pgSQL for the same reason: PostgreSQL
-- inlined the SQL function into every plain INSERT, parsing its body
-- again each time.
--
-- The wake-up trigger tests the relay's lock in its WHEN clause, so a
-- producer runs no trigger function unless a relay sleeps.

--- step
CREATE FUNCTION {{.RowCheckFunc}}(relayable boolean, aggregate_id text, type text, has_payload boolean,
    has_bytes boolean, content_type text, topic text, deliver_at timestamptz, headers jsonb)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    rule text;
    why text;
BEGIN
    -- In the order PostgreSQL ran the eight checks (by name), so a row that
    -- breaks two rules names the same one as before.
    IF content_type IS NOT NULL AND (octet_length(content_type) > 255 OR content_type ~ '[[:cntrl:]]'
        OR content_type !~ '^[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*[[:space:]]*(;.*)?$') THEN
        rule := 'ctype_check';
        why := 'content_type must be a media type (type/subtype, optional parameters) of at most 255 bytes';
    ELSIF deliver_at IS NOT NULL AND NOT isfinite(deliver_at) THEN
        rule := 'deliver_check';
        why := 'deliver_at must be a finite time';
    ELSIF relayable AND headers IS NOT NULL AND jsonb_typeof(headers) <> 'null'
        AND (jsonb_typeof(headers) <> 'object' OR jsonb_path_exists(headers, '$.* ? (@.type() != "string")')
             OR octet_length(headers::text) > 65536) THEN
        rule := 'headers_check';
        why := 'headers must be a JSON object of strings of at most 64 KiB';
    ELSIF octet_length(aggregate_id) NOT BETWEEN 1 AND 255 OR aggregate_id ~ '[[:cntrl:]]' THEN
        rule := 'key_check';
        why := 'aggregate_id must be 1 to 255 bytes without control characters';
    ELSIF (CASE WHEN content_type IS NULL OR lower(btrim(split_part(content_type, ';', 1))) ~ '^(application/json|[^/]+/[^/]+\+json)$'
        THEN NOT has_payload OR has_bytes ELSE has_payload OR NOT has_bytes END) THEN
        rule := 'payload_check';
        why := 'a JSON content type (or none) needs payload and no payload_bytes, any other payload_bytes and no payload';
    ELSIF relayable AND jsonb_typeof(headers) = 'object'
        AND headers ?| ARRAY['event_id', 'event_seq', 'event_uid', 'type', 'aggregate_id', 'content-type'] THEN
        rule := 'reserved_check';
        why := 'headers may not set event_id, event_seq, event_uid, type, aggregate_id or content-type: the relay sets them';
    ELSIF topic IS NOT NULL AND (octet_length(topic) NOT BETWEEN 1 AND 255 OR topic ~ '[[:space:][:cntrl:]]') THEN
        rule := 'topic_check';
        why := 'topic must be 1 to 255 bytes without whitespace or control characters';
    ELSIF relayable AND (octet_length(type) NOT BETWEEN 1 AND 255 OR type ~ '[[:space:][:cntrl:]]') THEN
        rule := 'type_check';
        why := 'type must be 1 to 255 bytes without whitespace or control characters';
    ELSE
        RETURN true;
    END IF;
    rule := {{.TableLiteral}} || '_' || rule;
    RAISE EXCEPTION 'new row for relation "%" violates check constraint "%": %', {{.TableLiteral}}, rule, why
        USING ERRCODE = 'check_violation', CONSTRAINT = rule, SCHEMA = {{.SchemaLiteral}}, TABLE = {{.TableLiteral}};
END
$$;

ALTER TABLE {{.Outbox}}
    DROP CONSTRAINT {{.KeyCheck}},
    DROP CONSTRAINT {{.PayloadCheck}},
    DROP CONSTRAINT {{.ContentTypeCheck}},
    DROP CONSTRAINT {{.TopicCheck}},
    DROP CONSTRAINT {{.DeliverCheck}},
    DROP CONSTRAINT {{.ReservedCheck}},
    DROP CONSTRAINT {{.TypeCheck}},
    DROP CONSTRAINT {{.HeadersCheck}},
    ADD CONSTRAINT {{.RowCheck}} CHECK (dispatched_at IS NOT NULL OR {{.RowCheckFunc}}(
        parked_at IS NULL AND retry_at IS DISTINCT FROM 'infinity', aggregate_id, type, payload IS NOT NULL,
        payload_bytes IS NOT NULL, content_type, topic, deliver_at, headers)) NOT VALID;

CREATE OR REPLACE FUNCTION {{.EventIDFunc}}() RETURNS uuid LANGUAGE plpgsql VOLATILE PARALLEL SAFE AS $$
BEGIN
    RETURN encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid())
        PLACING substring(int8send((extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
        FROM 1 FOR 6), 52, 1), 53, 1), 'hex')::uuid;
END
$$;

-- The relay's sleep (store.Sleep) holds this key; a producer that takes it
-- shared holds it until its commit, as migration 10's function did.
CREATE OR REPLACE FUNCTION {{.NotifyFunc}}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_ARGV[0], '');
    RETURN NULL;
END
$$;

DROP TRIGGER {{.NotifyTrigger}} ON {{.Outbox}};

CREATE TRIGGER {{.NotifyTrigger}} AFTER INSERT ON {{.Outbox}} FOR EACH STATEMENT
    WHEN (NOT pg_try_advisory_xact_lock_shared(hashtextextended({{.WakeKeyLiteral}}, 0)))
    EXECUTE FUNCTION {{.NotifyFunc}}({{.ChannelLiteral}});
