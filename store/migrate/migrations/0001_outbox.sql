-- The outbox and the consumer dedupe table. Migrate creates the schema.

--- step

CREATE TABLE {{.Outbox}} (
    id            BIGSERIAL PRIMARY KEY,
    uid           UUID NOT NULL,        -- identity unique across outboxes
    aggregate_id  UUID NOT NULL,
    type          TEXT NOT NULL,
    payload       JSON NOT NULL,        -- JSON, not JSONB: keeps the producer's exact bytes
    headers       JSONB,
    created_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    dispatched_at TIMESTAMPTZ,
    attempts      INTEGER NOT NULL DEFAULT 0,
    retry_at      TIMESTAMPTZ,          -- after a failed publish; 'infinity' holds for an operator
    last_error    TEXT,
    parked_at     TIMESTAMPTZ,          -- set aside by an operator; not relayed
    parked_reason TEXT
);

-- Serves the claim's ORDER BY id over pending rows only, so the scan never
-- walks dispatched rows.
CREATE INDEX {{.PendingIdx}} ON {{.Outbox}} (id)
    WHERE dispatched_at IS NULL AND parked_at IS NULL;

-- The ordered-mode gate: earlier pending events of one aggregate.
CREATE INDEX {{.AggregateIdx}} ON {{.Outbox}} (aggregate_id, id)
    WHERE dispatched_at IS NULL AND parked_at IS NULL;

-- Failed events, usually few: aggregates held back in ordered mode.
CREATE INDEX {{.RetryIdx}} ON {{.Outbox}} (aggregate_id)
    WHERE dispatched_at IS NULL AND parked_at IS NULL AND retry_at IS NOT NULL;

CREATE TABLE IF NOT EXISTS {{.Processed}} (
    consumer     TEXT NOT NULL,
    event_id     TEXT NOT NULL,         -- the event_uid header
    processed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);

CREATE INDEX IF NOT EXISTS {{.ProcessedAtIdx}} ON {{.Processed}} (processed_at);
