package outboxcli

import (
	"strings"
	"testing"
	"time"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/kafka"
)

// exactly_once reaches the Kafka section from the file and from the
// environment.
func TestExactlyOnceReachesKafka(t *testing.T) {
	for name, src := range map[string]struct {
		yaml string
		env  []string
	}{
		"file": {yaml: "broker: kafka\nbrokers:\n  kafka:\n    brokers: [h:9092]\n    exactly_once: true\n    transaction_timeout: 90s\n"},
		"environment": {env: []string{"OUTBOX_BROKER=kafka", "OUTBOX_BROKERS_KAFKA_BROKERS=h:9092",
			"OUTBOX_BROKERS_KAFKA_EXACTLY_ONCE=true", "OUTBOX_BROKERS_KAFKA_TRANSACTION_TIMEOUT=90s"}},
	} {
		t.Run(name, func(t *testing.T) {
			c, l, err := load(t, src.yaml, append(src.env, "DATABASE_URL=postgres://h/db"))
			if err != nil {
				t.Fatal(err)
			}
			var k kafka.Config
			if err := l.Section("kafka").Decode(&k); err != nil {
				t.Fatal(err)
			}
			if !k.ExactlyOnce || k.TransactionTimeout != 90*time.Second {
				t.Errorf("exactly_once %v transaction_timeout %s, want true 90s", k.ExactlyOnce, k.TransactionTimeout)
			}
			if err := c.ValidateRelay(); err != nil {
				t.Errorf("ordered, sharing relay with exactly_once: %v", err)
			}
		})
	}
}

// The relay refuses exactly_once with settings it cannot keep its promise
// under, naming the keys.
func TestExactlyOnceRefusesRelaySettings(t *testing.T) {
	base := []string{"DATABASE_URL=postgres://h/db", "OUTBOX_BROKER=kafka", "OUTBOX_BROKERS_KAFKA_BROKERS=h:9092",
		"OUTBOX_BROKERS_KAFKA_EXACTLY_ONCE=true"}
	cases := []struct {
		env  []string
		args []string
		want []string
	}{
		{args: []string{"--unordered"}, want: []string{"brokers.kafka.exactly_once", "relay.unordered"}},
		{env: []string{"OUTBOX_RELAY_SHARING=false"}, want: []string{"brokers.kafka.exactly_once", "relay.sharing"}},
		{env: []string{"OUTBOX_BROKERS_KAFKA_TRANSACTION_TIMEOUT=40s"}, want: []string{"brokers.kafka.transaction_timeout", "relay.publish_timeout"}},
		{env: []string{"OUTBOX_RELAY_PUBLISH_TIMEOUT=55s"}, want: []string{"brokers.kafka.transaction_timeout 1m0s", "relay.publish_timeout 55s"}},
	}
	for _, tc := range cases {
		c, _, err := load(t, "", append(append([]string{}, base...), tc.env...), tc.args...)
		if err != nil {
			t.Fatal(err)
		}
		err = c.ValidateRelay()
		for _, w := range tc.want {
			if err == nil || !strings.Contains(err.Error(), w) {
				t.Errorf("%v %v: ValidateRelay = %v, want an error naming %q", tc.env, tc.args, err, w)
			}
		}
	}
	// Without exactly_once the same settings are fine: the plain path
	// stays the default.
	c, _, err := load(t, "", []string{"DATABASE_URL=postgres://h/db", "OUTBOX_BROKER=kafka", "OUTBOX_BROKERS_KAFKA_BROKERS=h:9092",
		"OUTBOX_RELAY_SHARING=false"}, "--unordered")
	if err != nil {
		t.Fatal(err)
	}
	if err := c.ValidateRelay(); err != nil {
		t.Errorf("unordered without exactly_once: %v", err)
	}
	if _, ok := any(kafka.Config{}).(brokers.RelayChecker); !ok {
		t.Error("kafka.Config is not a brokers.RelayChecker")
	}
}
