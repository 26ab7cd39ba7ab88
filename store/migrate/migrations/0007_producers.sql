-- Producers as services write them: any string as the aggregate key,
-- payload bytes with a content type, a topic per event, a time before
-- which an event is not published, and one function that writes an event
-- from any language.
--
-- The aggregate key becomes text. COLLATE "C" compares bytes, as the uuid
-- column did, so the claim's indexes and the ordered gate stay as cheap:
-- no locale rules run per comparison. Existing keys keep their canonical
-- lowercase UUID text. Changing the column's type in place would rewrite
-- the table under an exclusive lock, stopping producers for as long as
-- the rewrite takes, so the text column is added beside it, kept in step
-- by a trigger, filled in batches, indexed concurrently and swapped in by
-- a catalog change. The new checks are added NOT VALID and validated
-- under a lock that lets producers go on.
--
-- payload stays JSON, so JSON payloads keep their exact bytes and their
-- validation by PostgreSQL. Any other content type goes in payload_bytes,
-- passed to the broker byte for byte. content_type NULL means
-- application/json. topic NULL leaves the choice to the relay's routing.
-- deliver_at holds the event until then (see the trigger below).

--- step
-- The trigger fills the new column in every row written from now on,
-- inserted or updated, so the checks hold for them at once. A producer
-- that sets aggregate_id_text itself gets it replaced.
CREATE FUNCTION {{.KeySyncFunc}}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.aggregate_id_text := NEW.aggregate_id::text;
    RETURN NEW;
END
$$;

ALTER TABLE {{.Outbox}}
    ADD COLUMN aggregate_id_text text COLLATE "C",
    ALTER COLUMN payload DROP NOT NULL,
    ADD COLUMN payload_bytes bytea,
    ADD COLUMN content_type  text,
    ADD COLUMN topic         text,
    ADD COLUMN deliver_at    timestamptz,
    ADD CONSTRAINT {{.KeyNotNull}} CHECK (aggregate_id_text IS NOT NULL) NOT VALID,
    ADD CONSTRAINT {{.KeyCheck}} CHECK (
        octet_length(aggregate_id_text) BETWEEN 1 AND 255 AND aggregate_id_text !~ '[[:cntrl:]]') NOT VALID,
    -- A JSON content type (application/json, anything ending in +json, or
    -- none) goes in payload, every other in payload_bytes; exactly one is set.
    ADD CONSTRAINT {{.PayloadCheck}} CHECK (CASE
        WHEN content_type IS NULL OR lower(btrim(split_part(content_type, ';', 1))) ~ '^(application/json|[^/]+/[^/]+\+json)$'
        THEN payload IS NOT NULL AND payload_bytes IS NULL
        ELSE payload IS NULL AND payload_bytes IS NOT NULL END) NOT VALID,
    ADD CONSTRAINT {{.ContentTypeCheck}} CHECK (content_type IS NULL OR (
        octet_length(content_type) <= 255 AND content_type !~ '[[:cntrl:]]'
        AND content_type ~ '^[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*[[:space:]]*(;.*)?$')) NOT VALID,
    ADD CONSTRAINT {{.TopicCheck}} CHECK (topic IS NULL OR (
        octet_length(topic) BETWEEN 1 AND 255 AND topic !~ '[[:space:][:cntrl:]]')) NOT VALID,
    ADD CONSTRAINT {{.DeliverCheck}} CHECK (deliver_at IS NULL OR isfinite(deliver_at)) NOT VALID,
    -- Header names the relay sets itself. NOT VALID for good, as the checks
    -- of migration 4: rows written before keep going out (the relay's
    -- values replace theirs), new ones are refused.
    ADD CONSTRAINT {{.ReservedCheck}} CHECK (
        dispatched_at IS NOT NULL OR parked_at IS NOT NULL OR retry_at IS NOT DISTINCT FROM 'infinity'
        OR headers IS NULL OR jsonb_typeof(headers) <> 'object'
        OR NOT headers ?| ARRAY['event_id', 'event_seq', 'event_uid', 'type', 'aggregate_id', 'content-type']
    ) NOT VALID;

-- The WHEN test runs without a function call, so the batches below, which
-- set the column themselves, pay for no trigger.
CREATE TRIGGER {{.KeySyncTrigger}} BEFORE INSERT OR UPDATE ON {{.Outbox}}
    FOR EACH ROW WHEN (NEW.aggregate_id_text IS DISTINCT FROM NEW.aggregate_id::text)
    EXECUTE FUNCTION {{.KeySyncFunc}}();

--- step batch
-- The rows written before the trigger, a range of seq at a time: row
-- locks on that range only.
UPDATE {{.Outbox}} SET aggregate_id_text = aggregate_id::text
WHERE seq >= $1 AND seq < $2 AND aggregate_id_text IS NULL;

--- step concurrently
-- The batches left a dead version of every row; vacuum clears them now,
-- so the index builds below read less and autovacuum does not hold the
-- table when the swap needs its lock.
VACUUM {{.Outbox}};

--- step concurrently
CREATE INDEX CONCURRENTLY IF NOT EXISTS {{.AggregateIdxNew}} ON {{.Outbox}} (aggregate_id_text, seq)
    WHERE dispatched_at IS NULL AND parked_at IS NULL;

--- step concurrently
CREATE INDEX CONCURRENTLY IF NOT EXISTS {{.RetryIdxNew}} ON {{.Outbox}} (aggregate_id_text)
    WHERE dispatched_at IS NULL AND parked_at IS NULL AND retry_at IS NOT NULL;

--- step
-- Scans of the table under SHARE UPDATE EXCLUSIVE: producers go on.
ALTER TABLE {{.Outbox}} VALIDATE CONSTRAINT {{.KeyNotNull}};
ALTER TABLE {{.Outbox}} VALIDATE CONSTRAINT {{.KeyCheck}};
ALTER TABLE {{.Outbox}} VALIDATE CONSTRAINT {{.PayloadCheck}};
ALTER TABLE {{.Outbox}} VALIDATE CONSTRAINT {{.ContentTypeCheck}};
ALTER TABLE {{.Outbox}} VALIDATE CONSTRAINT {{.TopicCheck}};
ALTER TABLE {{.Outbox}} VALIDATE CONSTRAINT {{.DeliverCheck}};

--- step
-- The swap, a catalog change: dropping the uuid column drops its two
-- indexes, and the new ones take their names; SET NOT NULL skips its scan
-- because the validated check proves it. It comes after the rename: from
-- PostgreSQL 18 on, a NOT NULL is a constraint named after the column it
-- is set on, and keeps that name through a rename.
DROP TRIGGER {{.KeySyncTrigger}} ON {{.Outbox}};
DROP FUNCTION {{.KeySyncFunc}}();
ALTER TABLE {{.Outbox}} DROP COLUMN aggregate_id;
ALTER TABLE {{.Outbox}} RENAME COLUMN aggregate_id_text TO aggregate_id;
ALTER TABLE {{.Outbox}} ALTER COLUMN aggregate_id SET NOT NULL;
ALTER TABLE {{.Outbox}} DROP CONSTRAINT {{.KeyNotNull}};
ALTER INDEX {{.Schema}}.{{.AggregateIdxNew}} RENAME TO {{.AggregateIdx}};
ALTER INDEX {{.Schema}}.{{.RetryIdxNew}} RENAME TO {{.RetryIdx}};

--- step
-- A scheduled event is one whose retry_at is set before its first
-- attempt: the claim leaves it pending until then and, in ordered mode,
-- holds the later events of its aggregate behind it, as it does for a
-- retry. The trigger fires only for rows that name a deliver_at, so other
-- inserts pay the WHEN test alone.
CREATE FUNCTION {{.ScheduleFunc}}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.retry_at := NEW.deliver_at;
    RETURN NEW;
END
$$;

CREATE TRIGGER {{.ScheduleTrigger}} BEFORE INSERT ON {{.Outbox}}
    FOR EACH ROW WHEN (NEW.deliver_at IS NOT NULL AND NEW.retry_at IS NULL)
    EXECUTE FUNCTION {{.ScheduleFunc}}();

-- The producer's function for any language: it checks its arguments with
-- errors naming the one at fault, fills event_id, inserts the row in the
-- caller's transaction and returns event_id. The table's trigger wakes the
-- relays at commit. The payload is bytes; the overloads below take text,
-- json and jsonb.
CREATE FUNCTION {{.WriteFunc}}(
    aggregate_id text, type text, payload bytea,
    headers jsonb DEFAULT NULL, topic text DEFAULT NULL, content_type text DEFAULT NULL,
    deliver_at timestamptz DEFAULT NULL, event_id uuid DEFAULT NULL
) RETURNS uuid LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_variable
DECLARE
    id   uuid := coalesce(event_id, {{.EventIDFunc}}());
    name text;
BEGIN
    IF aggregate_id IS NULL OR aggregate_id = '' THEN
        RAISE EXCEPTION 'outbox write: aggregate_id is empty' USING ERRCODE = 'invalid_parameter_value';
    ELSIF octet_length(aggregate_id) > 255 THEN
        RAISE EXCEPTION 'outbox write: aggregate_id is % bytes, over the limit of 255', octet_length(aggregate_id)
            USING ERRCODE = 'invalid_parameter_value';
    ELSIF aggregate_id ~ '[[:cntrl:]]' THEN
        RAISE EXCEPTION 'outbox write: aggregate_id contains a control character' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF type IS NULL OR type = '' THEN
        RAISE EXCEPTION 'outbox write: type is empty' USING ERRCODE = 'invalid_parameter_value';
    ELSIF octet_length(type) > 255 THEN
        RAISE EXCEPTION 'outbox write: type is % bytes, over the limit of 255', octet_length(type)
            USING ERRCODE = 'invalid_parameter_value';
    ELSIF type ~ '[[:space:][:cntrl:]]' THEN
        RAISE EXCEPTION 'outbox write: type % contains whitespace or a control character', quote_literal(type)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF payload IS NULL THEN
        RAISE EXCEPTION 'outbox write: payload is null' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF content_type IS NOT NULL AND (octet_length(content_type) > 255 OR content_type ~ '[[:cntrl:]]'
        OR content_type !~ '^[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*[[:space:]]*(;.*)?$') THEN
        RAISE EXCEPTION 'outbox write: content_type % is not a media type such as application/x-protobuf', quote_literal(left(content_type, 64))
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF headers IS NOT NULL AND jsonb_typeof(headers) = 'null' THEN
        headers := NULL;
    END IF;
    IF headers IS NOT NULL THEN
        IF jsonb_typeof(headers) <> 'object' OR jsonb_path_exists(headers, '$.* ? (@.type() != "string")') THEN
            RAISE EXCEPTION 'outbox write: headers are not a JSON object of strings' USING ERRCODE = 'invalid_parameter_value';
        ELSIF octet_length(headers::text) > 65536 THEN
            RAISE EXCEPTION 'outbox write: headers are % bytes as JSON, over the limit of 65536', octet_length(headers::text)
                USING ERRCODE = 'invalid_parameter_value';
        ELSIF headers ? '' THEN
            RAISE EXCEPTION 'outbox write: headers have an empty name' USING ERRCODE = 'invalid_parameter_value';
        END IF;
        SELECT k INTO name FROM jsonb_object_keys(headers) AS k
        WHERE k IN ('event_id', 'event_seq', 'event_uid', 'type', 'aggregate_id', 'content-type') LIMIT 1;
        IF name IS NOT NULL THEN
            RAISE EXCEPTION 'outbox write: header name % is set by the relay', quote_literal(name)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END IF;
    IF topic IS NOT NULL AND (octet_length(topic) NOT BETWEEN 1 AND 255 OR topic ~ '[[:space:][:cntrl:]]') THEN
        RAISE EXCEPTION 'outbox write: topic % is empty, over 255 bytes, or has whitespace or control characters', quote_literal(left(topic, 64))
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF deliver_at IS NOT NULL AND NOT isfinite(deliver_at) THEN
        RAISE EXCEPTION 'outbox write: deliver_at is not a finite time' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF content_type IS NULL OR lower(btrim(split_part(content_type, ';', 1))) ~ '^(application/json|[^/]+/[^/]+\+json)$' THEN
        -- convert_from refuses bytes that are not UTF-8, the cast what is not JSON.
        INSERT INTO {{.Outbox}} (event_id, aggregate_id, type, payload, headers, topic, content_type, deliver_at)
        VALUES (id, aggregate_id, type, convert_from(payload, 'UTF8')::json, headers, topic, content_type, deliver_at);
    ELSE
        INSERT INTO {{.Outbox}} (event_id, aggregate_id, type, payload_bytes, headers, topic, content_type, deliver_at)
        VALUES (id, aggregate_id, type, payload, headers, topic, content_type, deliver_at);
    END IF;
    RETURN id;
END
$$;

-- A quoted string literal has no type of its own; PostgreSQL picks the
-- text form for it, so psql callers can write the JSON inline.
CREATE FUNCTION {{.WriteFunc}}(
    aggregate_id text, type text, payload text,
    headers jsonb DEFAULT NULL, topic text DEFAULT NULL, content_type text DEFAULT NULL,
    deliver_at timestamptz DEFAULT NULL, event_id uuid DEFAULT NULL
) RETURNS uuid LANGUAGE sql VOLATILE AS $$
    SELECT {{.WriteFunc}}($1, $2, convert_to($3, 'UTF8'), $4, $5, $6, $7, $8)
$$;

CREATE FUNCTION {{.WriteFunc}}(
    aggregate_id text, type text, payload json,
    headers jsonb DEFAULT NULL, topic text DEFAULT NULL, content_type text DEFAULT NULL,
    deliver_at timestamptz DEFAULT NULL, event_id uuid DEFAULT NULL
) RETURNS uuid LANGUAGE sql VOLATILE AS $$
    SELECT {{.WriteFunc}}($1, $2, convert_to($3::text, 'UTF8'), $4, $5, $6, $7, $8)
$$;

CREATE FUNCTION {{.WriteFunc}}(
    aggregate_id text, type text, payload jsonb,
    headers jsonb DEFAULT NULL, topic text DEFAULT NULL, content_type text DEFAULT NULL,
    deliver_at timestamptz DEFAULT NULL, event_id uuid DEFAULT NULL
) RETURNS uuid LANGUAGE sql VOLATILE AS $$
    SELECT {{.WriteFunc}}($1, $2, convert_to($3::text, 'UTF8'), $4, $5, $6, $7, $8)
$$;
