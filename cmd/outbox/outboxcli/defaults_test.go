package outboxcli

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/cmd/outbox/console"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/logrelay"
)

// The defaults are stated once, in the library packages; the binary's
// configuration, README's table and docs/examples/outbox.yaml (which spells
// the defaults out) must say the same.
func TestDefaultsAgreeEverywhere(t *testing.T) {
	relay, err := core.Options{}.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	st, err := store.Config{}.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	lr, err := logrelay.Options{}.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	d := Defaults()
	// key, the library's default, the binary's default
	keys := []struct {
		key       string
		lib, bin  any
		inExample bool
	}{
		{"relay.batch_size", relay.BatchSize, d.Relay.BatchSize, true},
		{"relay.lanes", relay.Lanes, d.Relay.Lanes, true},
		{"relay.claimers", relay.Claimers, d.Relay.Claimers, true},
		{"relay.poll_interval", relay.PollInterval, d.Relay.PollInterval, true},
		{"relay.publish_timeout", relay.PublishTimeout, d.Relay.PublishTimeout, true},
		{"relay.shutdown_timeout", relay.ShutdownTimeout, d.Relay.ShutdownTimeout, true},
		{"relay.startup_timeout", 5 * time.Minute, d.Relay.StartupTimeout, true},
		{"relay.retry_min", relay.RetryBackoff.Min, d.Relay.RetryMin, true},
		{"relay.retry_max", relay.RetryBackoff.Max, d.Relay.RetryMax, true},
		{"store.schema", st.Schema, st.Schema, true},
		{"store.table", st.Table, st.Table, true},
		{"store.processed_table", st.ProcessedTable, st.ProcessedTable, true},
		{"store.max_event_bytes", st.MaxEventBytes, storeDefaults(t, d).MaxEventBytes, true},
		{"store.max_claim_bytes", st.MaxClaimBytes, storeDefaults(t, d).MaxClaimBytes, true},
		{"store.share_interval", st.ShareInterval, storeDefaults(t, d).ShareInterval, true},
		{"store.share_timeout", st.ShareTimeout, storeDefaults(t, d).ShareTimeout, true},
		{"relay.sharing", !relay.DisableSharing, d.Relay.Sharing, true},
		{"producer.max_payload_bytes", outbox.DefaultMaxPayloadBytes, d.Producer.MaxPayloadBytes, true},
		{"stuck.after", store.DefaultStuckAge, d.Stuck.After, true},
		{"console.lag_slo", console.DefaultLagSLO, d.Console.LagSLO, true},
		{"console.enabled", false, d.Console.Enabled, true},
		{"relay.mode", "table", d.Relay.Mode, true},
		{"broker", "(required)", required(d.Broker), false},
		{"relay.log.max_in_flight", lr.MaxInFlight, d.Relay.Log.MaxInFlight, true},
		{"relay.log.status_interval", lr.StatusInterval, d.Relay.Log.StatusInterval, true},
		{"relay.log.receive_timeout", lr.ReceiveTimeout, d.Relay.Log.ReceiveTimeout, true},
		{"relay.log.wal_sender_timeout", lr.WALSenderTimeout, d.Relay.Log.WALSenderTimeout, true},
		{"relay.log.standby_interval", lr.StandbyInterval, d.Relay.Log.StandbyInterval, true},
		{"relay.log.create_slot", !lr.ManualSlot, d.Relay.Log.CreateSlot, true},
		{"relay.log.handoff_after", lr.HandOffAfter, d.Relay.Log.HandOffAfter, true},
	}
	readme := readmeDefaults(t)
	example := exampleValues(t)
	for _, k := range keys {
		want := render(k.lib)
		if got := render(k.bin); got != want {
			t.Errorf("%s: the binary's default %s, the library's %s", k.key, got, want)
		}
		if got, ok := readme[k.key]; !ok || got != want {
			t.Errorf("%s: README's table says %q (listed %v), the library %q", k.key, got, ok, want)
		}
		if got, ok := example[k.key]; k.inExample && (!ok || got != want) {
			t.Errorf("%s: docs/examples/outbox.yaml says %q (present %v), the library %q", k.key, got, ok, want)
		}
	}
}

// required renders an empty default as README's table does.
func required(s string) string {
	if s == "" {
		return "(required)"
	}
	return s
}

func render(v any) string {
	if d, ok := v.(time.Duration); ok {
		s := d.String()
		for _, z := range []string{"0s", "0m"} {
			if strings.HasSuffix(s, z) && len(s) > len(z) && strings.ContainsAny(s[:len(s)-len(z)], "hm") {
				s = strings.TrimSuffix(s, z)
			}
		}
		return s
	}
	return fmt.Sprint(v)
}

// readmeDefaults reads README's configuration table: key -> default, with
// rows such as "`a` / `b` | x / y" split in two.
func readmeDefaults(t *testing.T) map[string]string {
	b, err := os.ReadFile("../../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		cells := strings.Split(line, "|")
		if len(cells) < 4 || !strings.HasPrefix(strings.TrimSpace(cells[1]), "`") {
			continue
		}
		keys := strings.Split(cells[1], " / ")
		vals := strings.Split(cells[2], " / ")
		if len(keys) != len(vals) {
			continue
		}
		for i := range keys {
			out[strings.Trim(strings.TrimSpace(keys[i]), "`")] = strings.Trim(strings.TrimSpace(vals[i]), "`")
		}
	}
	return out
}

// exampleValues flattens docs/examples/outbox.yaml to dotted keys.
func exampleValues(t *testing.T) map[string]string {
	b, err := os.ReadFile("../../../docs/examples/outbox.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	if err := yaml.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	var walk func(prefix string, m map[string]any)
	walk = func(prefix string, m map[string]any) {
		for k, v := range m {
			if sub, ok := v.(map[string]any); ok {
				walk(prefix+k+".", sub)
				continue
			}
			out[prefix+k] = fmt.Sprint(v)
		}
	}
	walk("", doc)
	return out
}

// storeDefaults is the binary's store section as the store fills it in.
func storeDefaults(t *testing.T, c Config) store.Config {
	s, err := c.StoreConfig().WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	return s
}
