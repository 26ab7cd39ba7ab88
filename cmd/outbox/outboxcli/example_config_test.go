package outboxcli

import (
	"testing"
	"time"

	"github.com/spf13/pflag"

	"github.com/outboxhq/outbox/brokers/amqp"
	"github.com/outboxhq/outbox/brokers/googlecloud"
	"github.com/outboxhq/outbox/brokers/kafka"
)

// The documented example configuration must load, validate and decode for
// every broker, so it cannot drift from the code.
func TestExampleConfigIsValid(t *testing.T) {
	fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
	AddFlags(fs)
	if err := fs.Parse([]string{"--config", "../../../docs/examples/outbox.yaml"}); err != nil {
		t.Fatal(err)
	}
	c, l, err := Load(fs, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	// Each adapter's own settings type refuses unknown keys.
	var (
		k kafka.Config
		a amqp.Config
		g googlecloud.Config
	)
	for name, v := range map[string]any{"kafka": &k, "amqp": &a, "googlecloud": &g} {
		if err := l.Section(name).Decode(v); err != nil {
			t.Fatalf("section %s: %v", name, err)
		}
	}
	// The example spells out the adapters' defaults (docs/brokers.md).
	if len(k.Brokers) != 2 || a.Channels != 256 || g.ProjectID != "my-project" || g.PublishTimeout != 10*time.Second {
		t.Errorf("broker sections not decoded or not the defaults: kafka %v, amqp channels %d (256), project %q, publish_timeout %s (10s)",
			k.Brokers, a.Channels, g.ProjectID, g.PublishTimeout)
	}
	if c.Relay.Claimers != 4 || c.Routing.TopicPrefix != "prod." || c.HTTP.Listen != ":9090" {
		t.Errorf("example values not loaded: %+v", c.Relay)
	}
}
