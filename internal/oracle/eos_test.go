package oracle_test

import (
	"time"

	"github.com/outboxhq/outbox/brokers/kafka"
)

// exactlyOnceBuilt says whether the Kafka publisher has its exactly-once
// mode; without it the exactly-once modes are skipped.
const exactlyOnceBuilt = true

// exactlyOnce turns the publisher's exactly-once mode on, with short
// bounds: a history settles within seconds.
func exactlyOnce(c *kafka.Config) {
	c.ExactlyOnce = true
	c.Timeout = 2 * time.Second
	c.DialTimeout = 2 * time.Second
}
