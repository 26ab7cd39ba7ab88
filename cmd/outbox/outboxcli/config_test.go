package outboxcli

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"

	_ "github.com/outboxhq/outbox/brokers/stdout"
)

func load(t *testing.T, yaml string, environ []string, args ...string) (*Config, *Loader, error) {
	t.Helper()
	fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
	AddFlags(fs)
	if yaml != "" {
		path := filepath.Join(t.TempDir(), "outbox.yaml")
		if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
			t.Fatal(err)
		}
		args = append(args, "--config", path)
	}
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	return Load(fs, environ)
}

func TestLoadPrecedence(t *testing.T) {
	yaml := "database_url: postgres://file/db\nbroker: gochannel\nrelay:\n  batch_size: 100\n  lanes: 4\n  poll_interval: 250ms\n"
	env := []string{"DATABASE_URL=postgres://env/db", "OUTBOX_RELAY_BATCH_SIZE=200"}
	c, _, err := load(t, yaml, env, "--batch-size", "300")
	if err != nil {
		t.Fatal(err)
	}
	if c.DatabaseURL != "postgres://env/db" {
		t.Errorf("database_url = %q, want the environment's over the file's", c.DatabaseURL)
	}
	if c.Relay.BatchSize != 300 {
		t.Errorf("batch_size = %d, want the flag's 300 over env 200 and file 100", c.Relay.BatchSize)
	}
	if c.Relay.Lanes != 4 || c.Relay.PollInterval != 250*time.Millisecond {
		t.Errorf("file values lost: lanes %d poll %s", c.Relay.Lanes, c.Relay.PollInterval)
	}
	if c.Broker != "gochannel" {
		t.Errorf("broker = %q, want gochannel from the file", c.Broker)
	}
	if c.Relay.PublishTimeout != 30*time.Second || !c.Relay.Wakeups {
		t.Errorf("defaults lost: publish_timeout %s wakeups %v", c.Relay.PublishTimeout, c.Relay.Wakeups)
	}
}

func TestLoadFlagsOverrideEnvironment(t *testing.T) {
	c, _, err := load(t, "", []string{"DATABASE_URL=postgres://env/db", "OUTBOX_BROKER=gochannel"},
		"--database-url", "postgres://flag/db", "--broker", "stdout", "--no-wakeups", "--unordered")
	if err != nil {
		t.Fatal(err)
	}
	if c.DatabaseURL != "postgres://flag/db" || c.Broker != "stdout" {
		t.Errorf("got %q %q, want the flags' values", c.DatabaseURL, c.Broker)
	}
	if c.Relay.Wakeups || !c.Relay.Unordered {
		t.Errorf("wakeups %v unordered %v, want false true", c.Relay.Wakeups, c.Relay.Unordered)
	}
}

func TestBrokerSectionFromFileAndEnvironment(t *testing.T) {
	yaml := "brokers:\n  kafka:\n    brokers: [a:9092, b:9092]\n    client_id: from-file\n"
	_, l, err := load(t, yaml, []string{"OUTBOX_BROKERS_KAFKA_SASL_PASSWORD=s3cret", "OUTBOX_BROKERS_KAFKA_CLIENT_ID=from-env"})
	if err != nil {
		t.Fatal(err)
	}
	var s struct {
		Brokers      []string `koanf:"brokers"`
		ClientID     string   `koanf:"client_id"`
		SASLPassword string   `koanf:"sasl_password"`
	}
	if err := l.Section("kafka").Decode(&s); err != nil {
		t.Fatal(err)
	}
	if len(s.Brokers) != 2 || s.ClientID != "from-env" || s.SASLPassword != "s3cret" {
		t.Errorf("decoded %+v", s)
	}
	var narrow struct {
		Brokers []string `koanf:"brokers"`
	}
	err = l.Section("kafka").Decode(&narrow)
	if err == nil || !strings.Contains(err.Error(), "brokers.kafka") || !strings.Contains(err.Error(), "client_id") {
		t.Errorf("unknown broker key: err = %v, want one naming brokers.kafka and client_id", err)
	}
}

func TestLoadRejectsUnknownKeys(t *testing.T) {
	_, _, err := load(t, "relay:\n  batchsize: 10\n", nil)
	if err == nil || !strings.Contains(err.Error(), "batchsize") {
		t.Fatalf("err = %v, want one naming the unknown key batchsize", err)
	}
}

func TestLoadRejectsBadValues(t *testing.T) {
	_, _, err := load(t, "relay:\n  poll_interval: soon\n", nil)
	if err == nil || !strings.Contains(err.Error(), "poll_interval") {
		t.Fatalf("err = %v, want one naming poll_interval", err)
	}
	_, _, err = load(t, "relay: [1, 2\n", nil)
	if err == nil || !strings.Contains(err.Error(), "config file") {
		t.Fatalf("malformed YAML: err = %v, want a config file error", err)
	}
	_, _, err = load(t, "", nil, "--config", filepath.Join(t.TempDir(), "missing.yaml"))
	if err == nil || !strings.Contains(err.Error(), "missing.yaml") {
		t.Fatalf("missing file: err = %v, want one naming the file", err)
	}
}

func TestValidateNamesFields(t *testing.T) {
	cases := []struct {
		name, yaml, field string
	}{
		{"no database", "broker: stdout\n", "database_url"},
		{"unknown broker", "database_url: postgres://x/y\nbroker: carrier-pigeon\n", "broker: unknown broker \"carrier-pigeon\""},
		{"batch size", "database_url: postgres://x/y\nrelay: {batch_size: 0}\n", "relay.batch_size"},
		{"lanes", "database_url: postgres://x/y\nrelay: {lanes: -1}\n", "relay.lanes"},
		{"retry order", "database_url: postgres://x/y\nrelay: {retry_min: 2m, retry_max: 1m}\n", "relay.retry_max"},
		{"log format", "database_url: postgres://x/y\nlog: {format: xml}\n", "log.format"},
		{"table name", "database_url: postgres://x/y\nstore: {table: " + strings.Repeat("t", 60) + "}\n", "table"},
		{"scheme", "database_url: mysql://x/y\n", "database_url"},
		{"event bytes", "database_url: postgres://x/y\nstore: {max_event_bytes: -5}\n", "max_event_bytes"},
		{"claim bytes", "database_url: postgres://x/y\nstore: {max_event_bytes: 2000, max_claim_bytes: 1000}\n", "max_claim_bytes"},
		{"share timeout", "database_url: postgres://x/y\nstore: {share_interval: 1s, share_timeout: 2s}\n", "share_timeout"},
		{"share interval", "database_url: postgres://x/y\nstore: {share_interval: 1ms}\n", "share_interval"},
		{"idle timeout", "database_url: postgres://x/y\ndatabase: {idle_in_transaction_timeout: 1s}\n", "database.idle_in_transaction_timeout"},
		{"routing", "database_url: postgres://x/y\nrouting: {types: {order.placed: \"\"}}\n", "routing.types"},
		{"cloudevents source", "database_url: postgres://x/y\ncloudevents: {enabled: true}\n", "cloudevents.source"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c, _, err := load(t, tc.yaml, nil)
			if err != nil {
				t.Fatal(err)
			}
			err = c.Validate()
			if err == nil || !strings.Contains(err.Error(), tc.field) {
				t.Fatalf("Validate() = %v, want an error naming %q", err, tc.field)
			}
		})
	}
	c, _, err := load(t, "database_url: postgres://x/y\n", nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); err != nil {
		t.Fatalf("defaults with a database URL should be valid: %v", err)
	}
}

// The log relay's settings mean in the file what they mean in
// logrelay.Options: 0 is the default, a negative wal_sender_timeout keeps
// the server's, create_slot false is ManualSlot.
func TestLogRelaySettingsMeanWhatTheLibrarySays(t *testing.T) {
	for _, tc := range []struct {
		yaml   string
		wst    time.Duration
		manual bool
	}{
		{"relay:\n  log:\n    wal_sender_timeout: 0s\n", 10 * time.Second, false},
		{"relay:\n  log:\n    wal_sender_timeout: -1s\n", -time.Second, false},
		{"relay:\n  log:\n    wal_sender_timeout: 3s\n    create_slot: false\n", 3 * time.Second, true},
	} {
		c, _, err := load(t, "broker: gochannel\n"+tc.yaml, nil)
		if err != nil {
			t.Fatalf("%q: %v", tc.yaml, err)
		}
		o, err := c.LogRelayOptions(nil, nil).WithDefaults()
		if err != nil {
			t.Fatalf("%q: %v", tc.yaml, err)
		}
		if o.WALSenderTimeout != tc.wst || o.ManualSlot != tc.manual {
			t.Errorf("%q: WALSenderTimeout %s ManualSlot %v, want %s %v", tc.yaml, o.WALSenderTimeout, o.ManualSlot, tc.wst, tc.manual)
		}
	}
}
