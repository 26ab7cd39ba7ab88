-- How many times an operator replayed the event (made it pending again
-- after it was published): a publisher that remembers what it sent
-- (exactly-once into Kafka) tells a replay, a new delivery, from a send
-- the table does not show yet. A constant default is added without
-- rewriting the table.

--- step
ALTER TABLE {{.Outbox}} ADD COLUMN IF NOT EXISTS replays INTEGER NOT NULL DEFAULT 0;

-- The handoff view's SELECT * was expanded when it was made (migration
-- 8): made again, it has the new column at its end. CREATE OR REPLACE
-- keeps the view's grants.
CREATE OR REPLACE VIEW {{.HandoffView}} AS
    SELECT * FROM {{.Outbox}} WHERE handoff_at IS NOT NULL;
