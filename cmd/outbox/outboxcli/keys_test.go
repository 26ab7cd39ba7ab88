package outboxcli

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/core"
)

// A setting the configuration does not have stops start-up, named with
// where it came from and the key that was probably meant, from the loader
// and from the relay command alike.
func TestUnknownConfigurationStopsStartup(t *testing.T) {
	cases := []struct {
		name string
		env  []string
		yaml string
		want string
	}{
		{name: "variable with a typo", env: []string{"OUTBOX_RELAY_POLLINTERVAL=1s"},
			want: "unknown environment variable OUTBOX_RELAY_POLLINTERVAL (did you mean OUTBOX_RELAY_POLL_INTERVAL?)"},
		{name: "variable of no key", env: []string{"OUTBOX_FOO=1"},
			want: "unknown environment variable OUTBOX_FOO"},
		{name: "broker variable with a typo", env: []string{"OUTBOX_BROKERS_KAFKA_SASL_PASWORD=x"},
			want: "unknown environment variable OUTBOX_BROKERS_KAFKA_SASL_PASWORD (did you mean OUTBOX_BROKERS_KAFKA_SASL_PASSWORD?)"},
		{name: "broker name with a typo", env: []string{"OUTBOX_BROKERS_KAKFA_BROKERS=a:9092"},
			want: "unknown environment variable OUTBOX_BROKERS_KAKFA_BROKERS (did you mean OUTBOX_BROKERS_KAFKA_BROKERS?)"},
		{name: "key of a broker not in use", env: []string{"OUTBOX_BROKER=stdout", "OUTBOX_BROKERS_AMQP_FOO=1"},
			want: "unknown environment variable OUTBOX_BROKERS_AMQP_FOO"},
		{name: "nested key", yaml: "broker: stdout\nrelay:\n  batchsize: 5\n",
			want: "outbox.yaml:3: unknown key relay.batchsize (did you mean relay.batch_size?)"},
		{name: "flow mapping", yaml: "relay: {lanes: 4, batchsize: 5}\n",
			want: "outbox.yaml:1: unknown key relay.batchsize (did you mean relay.batch_size?)"},
		{name: "top-level key", yaml: "broker: stdout\nlog:\n  level: info\nfoo: 1\n",
			want: "outbox.yaml:4: unknown key foo"},
		{name: "broker key", yaml: "brokers:\n  kafka:\n    brokers: [a:9092]\n    sasl_pasword: x\n",
			want: "outbox.yaml:4: unknown key brokers.kafka.sasl_pasword (did you mean brokers.kafka.sasl_password?)"},
		{name: "broker section", yaml: "broker: stdout\nbrokers:\n  kakfa:\n    brokers: [a:9092]\n",
			want: "outbox.yaml:3: unknown key brokers.kakfa (did you mean brokers.kafka?)"},
		{name: "merged from an anchor", yaml: "relay: &r\n  lanes: 4\nretention:\n  <<: *r\n",
			want: "outbox.yaml:2: unknown key retention.lanes"},
		{name: "dotted key", yaml: "relay.lanes: 3\n",
			want: "outbox.yaml:1: unknown key relay.lanes (write it nested: relay: {lanes: ...})"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, _, err := load(t, c.yaml, append([]string{"DATABASE_URL=postgres://x/y"}, c.env...))
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("Load: err = %v, want one saying %q", err, c.want)
			}

			t.Setenv("DATABASE_URL", "postgres://outbox@127.0.0.1:1/outbox?connect_timeout=3")
			for _, kv := range c.env {
				k, v, _ := strings.Cut(kv, "=")
				t.Setenv(k, v)
			}
			args := []string{"relay", "--broker", "gochannel"}
			if c.yaml != "" {
				path := filepath.Join(t.TempDir(), "outbox.yaml")
				if err := os.WriteFile(path, []byte(c.yaml), 0o600); err != nil {
					t.Fatal(err)
				}
				args = append(args, "--config", path)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_, errOut, err := runCLI(ctx, args...)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("relay: err = %v, want one saying %q\n%s", err, c.want, errOut)
			}
		})
	}
}

func init() {
	// A broker registered without a settings type: only its factory knows
	// its keys.
	brokers.Register("opaque_test", func(context.Context, brokers.Options) (core.Publisher, error) { return nil, nil })
}

// Variables that are not configuration, and sections whose keys only
// their broker knows, load as before.
func TestOtherVariablesAndOpenSectionsLoad(t *testing.T) {
	environ := []string{
		"DATABASE_URL=postgres://x/y",
		"OUTBOX_TEST_DATABASE_URL=postgres://test/db", "OUTBOX_TEST_ANYTHING=1",
		"OUTBOX_SERVICES_ENV=/tmp/env", "OUTBOX_FUZZ_COUNT=10", "OUTBOX_CHAOS_EVENTS=10",
		"OUTBOX_DRAIN_EVENTS=10", "OUTBOX_ORDERING_EVENTS=10", "OUTBOX_SCALE_ROWS=10", "OUTBOX_PLOT_DIR=/tmp",
		"OUTBOX_RELAY_POLL_INTERVAL=250ms", "OUTBOX_DATABASE_URL=postgres://outbox/db",
		"OUTBOX_BROKERS_KAFKA_SASL_PASSWORD=s", "OUTBOX_BROKERS_OPAQUE_TEST_ANY_KEY=v",
		"PATH=/bin", "outbox_lower_case=1",
	}
	yaml := "routing:\n  types:\n    order.placed: orders\nbrokers:\n  opaque_test:\n    whatever: {nested: 1}\n"
	c, l, err := load(t, yaml, environ)
	if err != nil {
		t.Fatal(err)
	}
	if c.Relay.PollInterval != 250*time.Millisecond || c.Routing.Types["order.placed"] != "orders" {
		t.Errorf("values lost: poll %s, types %v", c.Relay.PollInterval, c.Routing.Types)
	}
	var s struct {
		AnyKey   string         `koanf:"any_key"`
		Whatever map[string]int `koanf:"whatever"`
	}
	if err := l.Section("opaque_test").Decode(&s); err != nil || s.AnyKey != "v" || s.Whatever["nested"] != 1 {
		t.Errorf("open broker section: %+v, %v", s, err)
	}
}

// KnownKeys covers every flag's key, the broker sections and the keys
// the defaults leave empty, and no section that only holds keys.
func TestKnownKeys(t *testing.T) {
	keys := KnownKeys()
	want := []string{"database_url", "relay.poll_interval", "routing.topic", "routing.types", "http.listen",
		"tracing.enabled", "brokers.kafka.sasl_password", "brokers.amqp.url", "brokers.googlecloud.project_id"}
	for _, k := range flagKeys {
		want = append(want, k)
	}
	for _, k := range want {
		if !slices.Contains(keys, k) {
			t.Errorf("KnownKeys lacks %s", k)
		}
	}
	for _, k := range keys {
		if k == "relay" || k == "brokers" || k == "brokers.kafka" {
			t.Errorf("KnownKeys lists %s, not a settable key", k)
		}
	}
}

func TestEditDistance(t *testing.T) {
	cases := []struct {
		a, b string
		want int
	}{
		{"", "", 0}, {"abc", "", 3}, {"", "abc", 3}, {"kitten", "sitting", 3},
		{"batchsize", "batch_size", 1}, {"kakfa", "kafka", 2}, {"same", "same", 0},
	}
	for _, c := range cases {
		if got := editDistance(c.a, c.b); got != c.want {
			t.Errorf("editDistance(%q, %q) = %d, want %d", c.a, c.b, got, c.want)
		}
	}
}
