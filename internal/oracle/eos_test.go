package oracle_test

import "github.com/outboxhq/outbox/brokers/kafka"

// exactlyOnceBuilt says whether the Kafka publisher has its exactly-once
// mode yet; without it the exactly-once targets are skipped.
const exactlyOnceBuilt = false

// exactlyOnce turns the publisher's exactly-once mode on.
func exactlyOnce(*kafka.Config) {}
