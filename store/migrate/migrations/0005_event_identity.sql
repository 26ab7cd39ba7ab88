-- One vocabulary for event identity. event_id is the event's identity: the
-- header consumers dedupe on and the key of the processed table. seq is
-- the event's position in this table. Renaming keeps the data, indexes,
-- constraints and the sequence (still named after id) as they are: a
-- catalog change, in one transaction so no producer sees one name changed
-- and not the other.

--- step
ALTER TABLE {{.Outbox}} RENAME COLUMN uid TO event_id;
ALTER TABLE {{.Outbox}} RENAME COLUMN id TO seq;
