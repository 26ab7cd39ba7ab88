-- Ordered relays divide aggregates into 32 partitions, each claimed by one
-- relay at a time (store.Share). A claim reads its partitions' pending
-- events through this index, in seq order within each partition, and
-- merges them. The expression must stay the claim's (store.partitionOf).

--- step concurrently
CREATE INDEX CONCURRENTLY IF NOT EXISTS {{.PartitionIdx}} ON {{.Outbox}} ((hashtext(aggregate_id) & 31), seq)
    WHERE dispatched_at IS NULL AND parked_at IS NULL;
