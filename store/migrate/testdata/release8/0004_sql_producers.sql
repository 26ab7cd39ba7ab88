-- The table contract for producers that write plain SQL: a uid default,
-- unique uids, checks on what the relay cannot publish, and a wake-up that
-- needs no pg_notify call.

-- A time-ordered UUID (version 7, as the Go writer makes): 48 bits of Unix
-- milliseconds, then random bits with the version set to 7.
CREATE FUNCTION {{.EventIDFunc}}() RETURNS uuid LANGUAGE sql VOLATILE PARALLEL SAFE AS $$
    SELECT encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid())
        PLACING substring(int8send((extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
        FROM 1 FOR 6), 52, 1), 53, 1), 'hex')::uuid
$$;

ALTER TABLE {{.Outbox}} ALTER COLUMN uid SET DEFAULT {{.EventIDFunc}}();

-- Rows that already share a uid: consumers would drop all but the first as
-- duplicates. Later ones get a fresh uid so the unique index can be built;
-- those still pending are parked for an operator to look at, never
-- published unseen.
WITH dup AS (
    SELECT id, uid, row_number() OVER (PARTITION BY uid ORDER BY id) AS n FROM {{.Outbox}}
)
UPDATE {{.Outbox}} AS o
SET uid = {{.EventIDFunc}}(),
    parked_at = CASE WHEN o.dispatched_at IS NULL AND o.parked_at IS NULL THEN now() ELSE o.parked_at END,
    parked_reason = CASE WHEN o.dispatched_at IS NULL AND o.parked_at IS NULL
        THEN 'migration 4: uid ' || dup.uid || ' was already used by an earlier event; given a new uid'
        ELSE o.parked_reason END
FROM dup WHERE dup.id = o.id AND dup.n > 1;

CREATE UNIQUE INDEX {{.EventIDIdx}} ON {{.Outbox}} (uid);

-- Pending rows that break the checks below are held for an operator first,
-- as the relay would hold them, so the checks hold for every row. A held,
-- parked or dispatched row is exempt: an operator can still park it or
-- fix it.
UPDATE {{.Outbox}}
SET retry_at = 'infinity', attempts = attempts + 1,
    last_error = 'permanent: cannot relay row: held by migration 4: type or headers break the table''s checks'
WHERE dispatched_at IS NULL AND parked_at IS NULL AND retry_at IS DISTINCT FROM 'infinity'
  AND NOT (octet_length(type) BETWEEN 1 AND 255 AND type !~ '[[:space:][:cntrl:]]'
      AND (headers IS NULL OR jsonb_typeof(headers) = 'null' OR (jsonb_typeof(headers) = 'object'
          AND NOT jsonb_path_exists(headers, '$.* ? (@.type() != "string")')
          AND octet_length(headers::text) <= 65536)));

-- NOT VALID: new and updated rows are checked at once, without a scan of
-- the table under lock. Every existing row passes after the update above,
-- so `ALTER TABLE ... VALIDATE CONSTRAINT` succeeds when a DBA runs it.
ALTER TABLE {{.Outbox}} ADD CONSTRAINT {{.TypeCheck}} CHECK (
    dispatched_at IS NOT NULL OR parked_at IS NOT NULL OR retry_at IS NOT DISTINCT FROM 'infinity'
    OR (octet_length(type) BETWEEN 1 AND 255 AND type !~ '[[:space:][:cntrl:]]')
) NOT VALID;

ALTER TABLE {{.Outbox}} ADD CONSTRAINT {{.HeadersCheck}} CHECK (
    dispatched_at IS NOT NULL OR parked_at IS NOT NULL OR retry_at IS NOT DISTINCT FROM 'infinity'
    OR headers IS NULL OR jsonb_typeof(headers) = 'null'
    OR (jsonb_typeof(headers) = 'object'
        AND NOT jsonb_path_exists(headers, '$.* ? (@.type() != "string")')
        AND octet_length(headers::text) <= 65536)
) NOT VALID;

-- One NOTIFY per inserting statement wakes the relays, whoever the
-- producer is. PostgreSQL delivers it at commit, folds repeats within a
-- transaction into one, and drops it on rollback.
CREATE FUNCTION {{.NotifyFunc}}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_ARGV[0], '');
    RETURN NULL;
END
$$;

CREATE TRIGGER {{.NotifyTrigger}} AFTER INSERT ON {{.Outbox}}
    FOR EACH STATEMENT EXECUTE FUNCTION {{.NotifyFunc}}({{.ChannelLiteral}});
