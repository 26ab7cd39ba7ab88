package outboxcli

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/outboxhq/outbox/store/pgtest"
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
