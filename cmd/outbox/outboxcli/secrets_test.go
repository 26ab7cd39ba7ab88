package outboxcli

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// keywordDSN renders u as a libpq keyword/value connection string.
func keywordDSN(u *url.URL, extra string) string {
	host, port, _ := net.SplitHostPort(u.Host)
	s := fmt.Sprintf("host=%s port=%s user=%s dbname=%s sslmode=disable connect_timeout=3",
		host, port, u.User.Username(), strings.TrimPrefix(u.Path, "/"))
	return s + " " + extra
}

// Every form a credential takes in the configuration is masked in all that
// the commands print and return: logs, stdout and errors, whether the
// database is reached or not.
func TestCredentialsMaskedInEveryCommand(t *testing.T) {
	_, sc := pgtest.Schema(t)
	reachable, err := url.Parse(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	unreachable := &url.URL{Scheme: "postgres", User: url.User("outbox"), Host: "127.0.0.1:1", Path: "/outbox", RawQuery: "connect_timeout=3"}
	// The test server trusts local connections, so a password in any form
	// still connects to the reachable one and the commands run in full.
	secret := "Sx" + randomHex(8)
	withQuery := func(u *url.URL, key, value string) string {
		v := *u
		q := v.Query()
		q.Set(key, value)
		v.RawQuery = q.Encode()
		return v.String()
	}
	withUser := func(u *url.URL) string {
		v := *u
		v.User = url.UserPassword(u.User.Username(), secret+"@:/?")
		return v.String()
	}

	type form struct {
		name string
		env  func(db *url.URL) map[string]string
		yaml func(db *url.URL) string
	}
	dbForms := []form{
		{name: "user:password in URL", env: func(db *url.URL) map[string]string { return map[string]string{"DATABASE_URL": withUser(db)} }},
		{name: "password query parameter", env: func(db *url.URL) map[string]string {
			return map[string]string{"DATABASE_URL": withQuery(db, "password", secret)}
		}},
		{name: "sslpassword query parameter", env: func(db *url.URL) map[string]string {
			return map[string]string{"DATABASE_URL": withQuery(db, "sslpassword", secret)}
		}},
		{name: "keyword DSN", env: func(db *url.URL) map[string]string {
			return map[string]string{"DATABASE_URL": keywordDSN(db, "password="+secret)}
		}},
		{name: "quoted keyword DSN", env: func(db *url.URL) map[string]string {
			return map[string]string{"DATABASE_URL": keywordDSN(db, `password='a `+secret+` \' b'`)}
		}},
		{name: "PGPASSWORD", env: func(db *url.URL) map[string]string {
			return map[string]string{"DATABASE_URL": db.String(), "PGPASSWORD": secret}
		}},
		{name: "OUTBOX_DATABASE_URL", env: func(db *url.URL) map[string]string {
			return map[string]string{"OUTBOX_DATABASE_URL": withQuery(db, "password", secret)}
		}},
		{name: "URL in config file", yaml: func(db *url.URL) string {
			return "database_url: '" + withQuery(db, "password", secret) + "'\n"
		}},
		{name: "keyword DSN in config file", yaml: func(db *url.URL) string {
			return "database_url: \"" + keywordDSN(db, "sslpassword="+secret) + "\"\n"
		}},
	}
	brokerForms := []form{
		{name: "amqp URL", env: func(db *url.URL) map[string]string {
			return map[string]string{"DATABASE_URL": db.String(), "OUTBOX_BROKER": "amqp",
				"OUTBOX_BROKERS_AMQP_URL": "amqp://outbox:" + secret + "@127.0.0.1:1/", "OUTBOX_BROKERS_AMQP_CONNECT_TIMEOUT": "2s"}
		}},
		{name: "amqp password in config file", yaml: func(db *url.URL) string {
			return "database_url: '" + db.String() + "'\nbroker: amqp\nbrokers:\n  amqp:\n    url: amqp://127.0.0.1:1/\n" +
				"    connect_timeout: 2s\n    user: outbox\n    password: " + secret + "\n"
		}},
		{name: "kafka SASL password", env: func(db *url.URL) map[string]string {
			return map[string]string{"DATABASE_URL": db.String(), "OUTBOX_BROKER": "kafka",
				"OUTBOX_BROKERS_KAFKA_BROKERS": "127.0.0.1:1", "OUTBOX_BROKERS_KAFKA_DIAL_TIMEOUT": "2s",
				"OUTBOX_BROKERS_KAFKA_SASL_MECHANISM": "PLAIN", "OUTBOX_BROKERS_KAFKA_SASL_USER": "outbox",
				"OUTBOX_BROKERS_KAFKA_SASL_PASSWORD": secret}
		}},
		{name: "kafka SASL password in config file", yaml: func(db *url.URL) string {
			return "database_url: '" + db.String() + "'\nbroker: kafka\nbrokers:\n  kafka:\n    brokers: [127.0.0.1:1]\n" +
				"    dial_timeout: 2s\n    sasl_mechanism: SCRAM-SHA-256\n    sasl_user: outbox\n    sasl_password: " + secret + "\n"
		}},
	}
	commands := [][]string{
		{"relay"},
		{"status"},
		{"status", "--json"},
		{"migrate"},
		{"stuck"},
		{"grants", "--apply", "--relay-role", "r_" + randomHex(3)},
	}
	type run struct {
		name    string
		f       form
		db      *url.URL
		connect bool
		broker  bool // the form chooses the broker
		cmds    [][]string
	}
	var runs []run
	for _, f := range dbForms {
		runs = append(runs, run{f.name + "/reachable", f, reachable, true, false, commands},
			run{f.name + "/unreachable", f, unreachable, false, false, commands})
	}
	for _, f := range brokerForms {
		// The database is reached; the broker is not, or refuses.
		runs = append(runs, run{f.name, f, reachable, false, true, [][]string{{"relay"}, {"status"}}})
	}
	dir := t.TempDir()
	for _, r := range runs {
		for i, cmd := range r.cmds {
			name := r.name + "/" + strings.Join(cmd, " ")
			t.Run(name, func(t *testing.T) {
				t.Setenv("DATABASE_URL", "")
				os.Unsetenv("DATABASE_URL")
				t.Setenv("OUTBOX_RELAY_STARTUP_TIMEOUT", "1s") // an unreachable service fails the start soon
				args := append([]string{}, cmd...)
				format := []string{"text", "json"}[i%2]
				args = append(args, "--schema", sc.Schema, "--log-level", "debug", "--log-format", format)
				if r.f.env != nil {
					for k, v := range r.f.env(r.db) {
						t.Setenv(k, v)
					}
				}
				if r.f.yaml != nil {
					path := filepath.Join(dir, randomHex(4)+".yaml")
					if err := os.WriteFile(path, []byte(r.f.yaml(r.db)), 0o600); err != nil {
						t.Fatal(err)
					}
					args = append(args, "--config", path)
				}
				if cmd[0] == "relay" && !r.broker {
					args = append(args, "--broker", "gochannel")
				}
				timeout := 20 * time.Second
				if cmd[0] == "relay" && r.connect {
					timeout = 2 * time.Second // a relay that connects runs until stopped
				}
				ctx, cancel := context.WithTimeout(context.Background(), timeout)
				defer cancel()
				out, errOut, err := runCLI(ctx, args...)
				texts := []string{out, errOut}
				if err != nil {
					texts = append(texts, err.Error(), fmt.Sprintf("%v|%+v|%#v", err, err, err))
				}
				assertNoSecret(t, []string{secret}, name, texts...)
				switch {
				case !r.connect && cmd[0] == "relay" && err == nil:
					t.Errorf("relay started although it cannot connect:\n%s", errOut)
				case r.connect && cmd[0] == "relay" && !strings.Contains(errOut, "relay starting"):
					t.Errorf("relay did not start (err %v):\n%s", err, errOut)
				case r.connect && cmd[0] == "status" && err != nil:
					t.Errorf("status: %v", err)
				}
			})
		}
	}
}

// Redact masks each form a credential takes and leaves the rest alone.
func TestRedact(t *testing.T) {
	cases := []struct {
		name, in, want string
	}{
		{"URL password", "postgres://relay:hunter2@db:5432/app?sslmode=require", "postgres://relay:xxxxx@db:5432/app?sslmode=require"},
		{"URL password with an @", "postgres://relay:hun@ter2@db/app", "postgres://relay:xxxxx@db/app"},
		{"escaped URL password", "postgresql://relay:hun%40ter%2F2@db/app", "postgresql://relay:xxxxx@db/app"},
		{"password parameter", "postgres://relay@db/app?password=hunter2&sslmode=require", "postgres://relay@db/app?password=xxxxx&sslmode=require"},
		{"sslpassword parameter", "postgres://relay@db/app?sslmode=verify-full&sslpassword=hunter2", "postgres://relay@db/app?sslmode=verify-full&sslpassword=xxxxx"},
		{"escaped parameter name", "postgres://db/app?pass%77ord=hunter2", "postgres://db/app?pass%77ord=xxxxx"},
		{"keyword DSN", "host=db password=hunter2 user=relay", "host=db password=xxxxx user=relay"},
		{"quoted keyword DSN", `host=db password='hun ter\'2' user=relay`, "host=db password=xxxxx user=relay"},
		{"spaced keyword DSN", "host=db password = hunter2 user=relay", "host=db password = xxxxx user=relay"},
		{"amqp URL", "dial amqp://guest:hunter2@rabbit:5672/vhost: refused", "dial amqp://guest:xxxxx@rabbit:5672/vhost: refused"},
		{"in a quoted log value", `msg=x database="postgres://u@h/db?password=hunter2"`, `msg=x database="postgres://u@h/db?password=xxxxx"`},
		{"log attribute", "level=INFO sasl_password=hunter2 broker=kafka", "level=INFO sasl_password=xxxxx broker=kafka"},
		{"environment variable", "OUTBOX_BROKERS_AMQP_PASSWORD=hunter2", "OUTBOX_BROKERS_AMQP_PASSWORD=xxxxx"},
		{"JSON credentials", `{"type": "service_account", "private_key": "-----BEGIN hunter2\n", "client_secret":"hunter2"}`,
			`{"type": "service_account", "private_key": "xxxxx", "client_secret":"xxxxx"}`},
		{"no password", "postgres://relay@db:5432/app?sslmode=require", "postgres://relay@db:5432/app?sslmode=require"},
		{"no password, port", "amqp://rabbit:5672/", "amqp://rabbit:5672/"},
		{"files are not secrets", "tls_key_file=/etc/k.pem credentials_file=/etc/sa.json sslkey=/k", "tls_key_file=/etc/k.pem credentials_file=/etc/sa.json sslkey=/k"},
		{"plain text", "relay: 5 events in 3ms (batch_size=500)", "relay: 5 events in 3ms (batch_size=500)"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if got := Redact(c.in); got != c.want {
				t.Errorf("Redact(%q)\n = %q\nwant %q", c.in, got, c.want)
			}
		})
	}
}

// The masker finds a configured secret however it was spelled on output,
// and the secrets are found in each form of configuration value.
func TestMaskerFindsEverySpelling(t *testing.T) {
	secret := `pa ss@w:o/r?d'"\%` + randomHex(4)
	var m masker
	m.add(secret)
	var logged strings.Builder
	for _, format := range []string{"text", "json"} {
		newLogger(m.writer(&logged), LogConfig{Format: format, Level: "info"}).Info("x", "v", secret, "err", fmt.Errorf("%q", secret))
	}
	for _, s := range append(spellings(secret), logged.String(), fmt.Sprintf("%q", secret)) {
		if got := m.mask("<" + s + ">"); strings.Contains(got, secret) || strings.Contains(got, "ss@w") {
			t.Errorf("mask(%q) = %q", s, got)
		}
	}
	if got := m.mask("ab"); got != "ab" {
		t.Errorf("masked text without a secret: %q", got)
	}

	cases := []struct {
		name, value string
		want        []string
	}{
		{"URL", "postgres://u:p%40w@h/db", []string{"p@w"}},
		{"query", "postgres://u@h/db?sslmode=disable&password=s3cret&sslpassword=k3y", []string{"s3cret", "k3y"}},
		{"malformed URL", "postgres://u:s3cret@h:no-port/db", []string{"s3cret"}},
		{"keyword", `host=h password='a \' b' sslpassword=k3y`, []string{"a ' b", "k3y"}},
		{"amqp", "amqp://guest:s3cret@rabbit/", []string{"s3cret"}},
		{"none", "postgres://u@h/db?sslmode=require", nil},
	}
	for _, c := range cases {
		got := dsnSecrets(c.value)
		for _, w := range c.want {
			if !slices.Contains(got, w) {
				t.Errorf("%s: dsnSecrets(%q) = %q, want %q among them", c.name, c.value, got, w)
			}
		}
		if c.want == nil && len(got) > 0 {
			t.Errorf("%s: dsnSecrets(%q) = %q, want none", c.name, c.value, got)
		}
	}
}
