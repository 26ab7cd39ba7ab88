package outboxcli

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/sys/unix"

	"github.com/outboxhq/outbox"
	_ "github.com/outboxhq/outbox/brokers/amqp"
	"github.com/outboxhq/outbox/brokers/gochannel"
	_ "github.com/outboxhq/outbox/brokers/kafka"
	"github.com/outboxhq/outbox/dedupe"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
)

// runCLI runs the outbox command line in-process and returns everything it
// wrote and its error. The environment is the test's own (t.Setenv).
func runCLI(ctx context.Context, args ...string) (stdout, stderr string, err error) {
	var out, errOut bytes.Buffer
	root := NewRoot(&out, &errOut)
	root.SetArgs(args)
	err = root.ExecuteContext(ctx)
	return out.String(), errOut.String(), err
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// passwordGroup is a role whose members must log in with their password on
// the test server, which otherwise trusts every local connection.
const passwordGroup = "outbox_password_auth"

// passwordRole creates a login role that the test server authenticates by
// password (SCRAM), and returns a URL for it without the password.
func passwordRole(t *testing.T, password string) (role string, roleURL *url.URL) {
	t.Helper()
	admin := pgtest.NewPool(t)
	ctx := context.Background()
	requirePasswords(t, admin)
	role = "outbox_pw_" + randomHex(4)
	if _, err := admin.Exec(ctx, "CREATE ROLE "+pgx.Identifier{role}.Sanitize()+" LOGIN PASSWORD '"+password+"' IN ROLE "+passwordGroup); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, s := range []string{"DROP OWNED BY ", "DROP ROLE "} {
			if _, err := admin.Exec(context.Background(), s+pgx.Identifier{role}.Sanitize()); err != nil {
				t.Logf("%s%s: %v", s, role, err)
			}
		}
	})
	u, err := url.Parse(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(role)
	// The wrong-password check below proves the server asks for it.
	assertPasswordRequired(t, u)
	return role, u
}

// requirePasswords puts a SCRAM rule for members of passwordGroup at the top
// of the server's pg_hba.conf, once, and reloads it. It needs the file to be
// writable here, as it is for the server scripts/services.sh starts.
func requirePasswords(t *testing.T, admin *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	var hba string
	if err := admin.QueryRow(ctx, "SHOW hba_file").Scan(&hba); err != nil {
		t.Fatalf("find pg_hba.conf: %v", err)
	}
	old, err := os.ReadFile(hba)
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("read %s to require passwords: %v", hba, err)
		}
		t.Skipf("cannot read the server's pg_hba.conf to require passwords: %v", err)
	}
	if _, err := admin.Exec(ctx, "CREATE ROLE "+passwordGroup+" NOLOGIN"); err != nil {
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || (pgErr.Code != "42710" && pgErr.Code != "23505") { // duplicate_object, a concurrent create
			t.Fatal(err)
		}
	}
	rule := "host all +" + passwordGroup + " 127.0.0.1/32 scram-sha-256\n" +
		"host all +" + passwordGroup + " ::1/128 scram-sha-256\n"
	if !bytes.Contains(old, []byte(rule)) {
		if err := os.WriteFile(hba, append([]byte(rule), old...), 0o600); err != nil {
			t.Fatalf("require passwords in %s: %v", hba, err)
		}
	}
	if _, err := admin.Exec(ctx, "SELECT pg_reload_conf()"); err != nil {
		t.Fatal(err)
	}
}

func assertPasswordRequired(t *testing.T, u *url.URL) {
	t.Helper()
	wrong := *u
	wrong.User = url.UserPassword(u.User.Username(), "not-the-password")
	deadline := time.Now().Add(10 * time.Second) // the reload is asynchronous
	for {
		conn, err := pgx.Connect(context.Background(), wrong.String())
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "28P01" { // invalid_password
			return
		}
		if conn != nil {
			_ = conn.Close(context.Background())
		}
		if time.Now().After(deadline) {
			t.Fatalf("the server does not ask %s for a password (last: %v)", u.User.Username(), err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func assertNoSecret(t *testing.T, secrets []string, what string, texts ...string) {
	t.Helper()
	for _, s := range secrets {
		for _, text := range texts {
			if strings.Contains(text, s) {
				t.Errorf("%s: the password appears in the output:\n%s", what, text)
			}
		}
	}
}

// A database password must not reach logs or error messages, whether the
// database is unreachable, refuses the password or the URL is malformed.
func TestDatabasePasswordNeverPrinted(t *testing.T) {
	password := "Pw-" + randomHex(8) + "@:/%?"
	escaped := url.UserPassword("u", password).String()
	secrets := []string{password, strings.TrimPrefix(escaped, "u:"), url.QueryEscape(password)}
	_, roleURL := passwordRole(t, "the-right-one-"+randomHex(4))

	withPassword := func(u url.URL) string {
		u.User = url.UserPassword(u.User.Username(), password)
		return u.String()
	}
	inQuery := func(u url.URL) string {
		q := u.Query()
		q.Set("password", password)
		u.RawQuery = q.Encode()
		return u.String()
	}
	unreachable := url.URL{Scheme: "postgres", User: url.User("outbox"), Host: "127.0.0.1:1", Path: "/outbox", RawQuery: "connect_timeout=3"}
	cases := []struct {
		name, dsn, want string
	}{
		{"wrong password", withPassword(*roleURL), "password authentication failed"},
		{"wrong password in the query", inQuery(*roleURL), "password authentication failed"},
		{"password in the query, unreachable host", inQuery(unreachable), "connect to database"},
		{"unreachable host", withPassword(unreachable), "connect to database"},
		{"malformed URL", strings.Replace(withPassword(unreachable), ":1/", ":no-port/", 1), "database_url"},
		{"key-value DSN", "host=127.0.0.1 port=1 user=outbox dbname=outbox connect_timeout=3 password='" + strings.ReplaceAll(password, "'", `\'`) + "'", "connect to database"},
	}
	commands := [][]string{
		{"migrate"},
		{"relay", "--broker", "gochannel"},
		{"grants", "--apply", "--relay-role", "r"},
	}
	for _, c := range cases {
		for _, cmd := range commands {
			for _, via := range []string{"flag", "env"} {
				name := c.name + "/" + cmd[0] + "/" + via
				t.Run(name, func(t *testing.T) {
					args := append([]string{}, cmd...)
					args = append(args, "--log-level", "debug", "--log-format", "json")
					if via == "flag" {
						args = append(args, "--database-url", c.dsn)
					} else {
						t.Setenv("DATABASE_URL", c.dsn)
					}
					t.Setenv("OUTBOX_RELAY_STARTUP_TIMEOUT", "1s") // the relay fails its start soon
					ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
					defer cancel()
					out, errOut, err := runCLI(ctx, args...)
					if err == nil {
						t.Fatalf("no error; output:\n%s%s", out, errOut)
					}
					if !strings.Contains(err.Error(), c.want) {
						t.Errorf("error %q does not say %q", err, c.want)
					}
					assertNoSecret(t, secrets, name, err.Error(), out, errOut, fmt.Sprintf("%#v", err))
				})
			}
		}
	}
}

// ownSchema makes role the owner of a new schema, able to migrate it.
// Migrate's CREATE SCHEMA IF NOT EXISTS needs CREATE on the database even
// when the schema exists.
func ownSchema(ctx context.Context, admin *pgxpool.Pool, schema, role string) error {
	var db string
	if err := admin.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
		return err
	}
	r := pgx.Identifier{role}.Sanitize()
	_, err := admin.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()+" AUTHORIZATION "+r+
		"; GRANT CREATE ON DATABASE "+pgx.Identifier{db}.Sanitize()+" TO "+r)
	return err
}

// Broker credentials stay out of the output too, when the broker refuses
// them or cannot be reached.
func TestBrokerPasswordNeverPrinted(t *testing.T) {
	_, cfg := pgtest.Schema(t)
	password := "Bk-" + randomHex(8)
	cases := map[string][]string{
		"amqp unreachable": {"OUTBOX_BROKER=amqp", "OUTBOX_BROKERS_AMQP_URL=amqp://outbox:" + password + "@127.0.0.1:1/"},
		"amqp password key": {"OUTBOX_BROKER=amqp", "OUTBOX_BROKERS_AMQP_URL=amqp://127.0.0.1:1/",
			"OUTBOX_BROKERS_AMQP_USER=outbox", "OUTBOX_BROKERS_AMQP_PASSWORD=" + password},
		"kafka SASL unreachable": {"OUTBOX_BROKER=kafka", "OUTBOX_BROKERS_KAFKA_BROKERS=127.0.0.1:1",
			"OUTBOX_BROKERS_KAFKA_DIAL_TIMEOUT=2s", "OUTBOX_BROKERS_KAFKA_SASL_MECHANISM=PLAIN",
			"OUTBOX_BROKERS_KAFKA_SASL_USER=outbox", "OUTBOX_BROKERS_KAFKA_SASL_PASSWORD=" + password},
	}
	if u := os.Getenv("OUTBOX_TEST_AMQP_URL"); u != "" {
		wrong, err := url.Parse(u)
		if err != nil {
			t.Fatal(err)
		}
		wrong.User = url.UserPassword(wrong.User.Username(), password)
		cases["amqp wrong password"] = []string{"OUTBOX_BROKER=amqp", "OUTBOX_BROKERS_AMQP_URL=" + wrong.String()}
	}
	for name, environ := range cases {
		t.Run(name, func(t *testing.T) {
			t.Setenv("DATABASE_URL", pgtest.URL(t))
			t.Setenv("OUTBOX_RELAY_STARTUP_TIMEOUT", "1s")
			for _, kv := range environ {
				k, v, _ := strings.Cut(kv, "=")
				t.Setenv(k, v)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			out, errOut, err := runCLI(ctx, "relay", "--schema", cfg.Schema, "--log-level", "debug")
			if err == nil {
				t.Fatalf("relay started; output:\n%s", errOut)
			}
			if !strings.Contains(err.Error(), "broker") {
				t.Errorf("error %q does not name the broker", err)
			}
			assertNoSecret(t, []string{password}, name, err.Error(), out, errOut)
		})
	}
}

// A relay that connects logs its database URL with the password masked.
func TestRunningRelayLogsNoPassword(t *testing.T) {
	password := "Pw-" + randomHex(8)
	role, roleURL := passwordRole(t, password)
	admin := pgtest.NewPool(t)
	ctx := context.Background()
	schema := "sec_" + randomHex(4)
	if err := ownSchema(ctx, admin, schema, role); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = admin.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE") })
	u := *roleURL
	u.User = url.UserPassword(role, password)
	t.Setenv("DATABASE_URL", u.String())
	if _, _, err := runCLI(ctx, "migrate", "--schema", schema); err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	out, errOut, err := runCLI(rctx, "relay", "--schema", schema, "--broker", "gochannel", "--log-level", "debug")
	if err != nil {
		t.Fatalf("relay: %v\n%s", err, errOut)
	}
	if !strings.Contains(errOut, "relay starting") || !strings.Contains(errOut, "xxxxx") {
		t.Errorf("relay did not log its masked database URL:\n%s", errOut)
	}
	assertNoSecret(t, []string{password}, "running relay", out, errOut)
}

// Credentials can stay out of the URL and the configuration: libpq's
// password file and PGPASSWORD work as they do for psql.
func TestPasswordFromFileOrEnvironment(t *testing.T) {
	password := "Pw-" + randomHex(8)
	role, roleURL := passwordRole(t, password)
	admin := pgtest.NewPool(t)
	ctx := context.Background()
	schema := "sec_" + randomHex(4)
	if err := ownSchema(ctx, admin, schema, role); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = admin.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE") })
	t.Setenv("DATABASE_URL", roleURL.String()) // no password in it

	if _, _, err := runCLI(ctx, "migrate", "--schema", schema); err == nil {
		t.Fatal("migrate without any password succeeded: the server does not check passwords")
	}

	passfile := filepath.Join(t.TempDir(), "pgpass")
	line := fmt.Sprintf("%s:%s:*:%s:%s\n", roleURL.Hostname(), roleURL.Port(), role, password)
	if err := os.WriteFile(passfile, []byte(line), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PGPASSFILE", passfile)
	out, errOut, err := runCLI(ctx, "migrate", "--schema", schema)
	if err != nil {
		t.Fatalf("migrate with a password file: %v\n%s", err, errOut)
	}
	assertNoSecret(t, []string{password}, "migrate", out, errOut)

	t.Setenv("PGPASSFILE", filepath.Join(t.TempDir(), "none"))
	t.Setenv("PGPASSWORD", password)
	if _, errOut, err := runCLI(ctx, "migrate", "--schema", schema); err != nil {
		t.Fatalf("migrate with PGPASSWORD: %v\n%s", err, errOut)
	}
}

// Names and routing values from configuration are data, never SQL: an
// outbox whose every name is an injection attempt migrates, relays and is
// granted, and the canary table survives.
func TestConfigValuesCannotInjectSQL(t *testing.T) {
	admin := pgtest.NewPool(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	canary := "cn_" + randomHex(4)
	if _, err := admin.Exec(ctx, "CREATE TABLE public."+canary+" (x int)"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = admin.Exec(context.Background(), "DROP TABLE IF EXISTS public."+canary) })
	drop := "DROP TABLE public." + canary + "; --"
	schema := `s"; ` + drop
	table := `t'); ` + drop
	processed := `p"; ` + drop
	channel := `c'; SELECT 1; ` + drop
	role := `r"; ` + drop
	prefix := `q'; ` + drop + "."
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
		_, _ = admin.Exec(context.Background(), "DROP ROLE IF EXISTS "+pgx.Identifier{role}.Sanitize())
	})
	if _, err := admin.Exec(ctx, "CREATE ROLE "+pgx.Identifier{role}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	yamlQuote := func(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }
	config := "store:\n" +
		"  schema: " + yamlQuote(schema) + "\n" +
		"  table: " + yamlQuote(table) + "\n" +
		"  notify_channel: " + yamlQuote(channel) + "\n" +
		"routing:\n  topic_prefix: " + yamlQuote(prefix) + "\n" +
		"  types:\n    " + yamlQuote("order.placed") + ": " + yamlQuote(`orders"; `+drop) + "\n" +
		"broker: gochannel\n" +
		"relay:\n  poll_interval: 100ms\n"
	path := filepath.Join(t.TempDir(), "outbox.yaml")
	if err := os.WriteFile(path, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("DATABASE_URL", pgtest.URL(t))
	// One name comes from the environment, the way the others could.
	t.Setenv("OUTBOX_STORE_PROCESSED_TABLE", processed)

	if _, errOut, err := runCLI(ctx, "migrate", "--config", path); err != nil {
		t.Fatalf("migrate: %v\n%s", err, errOut)
	}
	var tables []string
	rows, err := admin.Query(ctx, "SELECT tablename FROM pg_tables WHERE schemaname = $1 ORDER BY 1", schema)
	if err != nil {
		t.Fatal(err)
	}
	tables, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	want := []string{processed, table, table + "_log_slot", table + "_migrations"}
	if strings.Join(tables, "|") != strings.Join(want, "|") {
		t.Fatalf("tables in schema %q: %q, want %q", schema, tables, want)
	}
	if _, errOut, err := runCLI(ctx, "grants", "--config", path, "--apply", "--relay-role", role, "--producer-role", role); err != nil {
		t.Fatalf("grants: %v\n%s", err, errOut)
	}

	// An event written by a producer with the same names goes out on the
	// configured topic, its name unchanged.
	topic := prefix + `orders"; ` + drop
	msgs, err := gochannel.Shared().Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	sc := store.Config{Schema: schema, Table: table, ProcessedTable: processed, NotifyChannel: channel}
	w, err := outbox.NewWriter(outbox.WriterOptions{Store: sc})
	if err != nil {
		t.Fatal(err)
	}
	agg := uuid.NewString()
	if err := pgx.BeginFunc(ctx, admin, func(tx pgx.Tx) error {
		return w.Write(ctx, tx, outbox.Message{AggregateID: agg, Type: "order.placed", Payload: map[string]string{"drop": drop}})
	}); err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	var relayErr bytes.Buffer
	go func() {
		root := NewRoot(&bytes.Buffer{}, &relayErr)
		root.SetArgs([]string{"relay", "--config", path})
		relayDone <- root.ExecuteContext(rctx)
	}()
	var got *message.Message
	select {
	case got = <-msgs:
		got.Ack()
	case err := <-relayDone:
		t.Fatalf("relay stopped: %v\n%s", err, relayErr.String())
	case <-time.After(30 * time.Second):
		t.Fatalf("no event on topic %q\n%s", topic, relayErr.String())
	}
	stop()
	if err := <-relayDone; err != nil {
		t.Fatalf("relay: %v", err)
	}
	if got.Metadata.Get("aggregate_id") != agg {
		t.Errorf("event for aggregate %q, want %q", got.Metadata.Get("aggregate_id"), agg)
	}
	var pending int
	if err := admin.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{schema, table}.Sanitize()+" WHERE dispatched_at IS NULL").Scan(&pending); err != nil {
		t.Fatal(err)
	}
	if pending != 0 {
		t.Errorf("%d events still pending", pending)
	}
	var exists bool
	if err := admin.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", "public."+canary).Scan(&exists); err != nil || !exists {
		t.Fatalf("canary table is gone (%v): a configured value ran as SQL", err)
	}
}

// Each kind of bad input gets one error that names the problem.
func TestBadInputNamesTheProblem(t *testing.T) {
	dir := t.TempDir()
	file := func(body string) string {
		p := filepath.Join(dir, randomHex(4)+".yaml")
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	dsn := "postgres://outbox@127.0.0.1:1/outbox?connect_timeout=3"
	cases := []struct {
		name string
		args []string
		want string
	}{
		{"malformed YAML", []string{"migrate", "--config", file("relay: [batch_size: 1\n")}, "yaml"},
		{"missing file", []string{"migrate", "--config", filepath.Join(dir, "absent.yaml")}, "config file"},
		{"unknown key", []string{"migrate", "--config", file("relay:\n  batchsize: 5\n")}, "batchsize"},
		{"wrong type", []string{"migrate", "--config", file("relay:\n  batch_size: lots\n")}, "batch_size"},
		{"bad duration", []string{"migrate", "--config", file("relay:\n  poll_interval: soon\n")}, "poll_interval"},
		{"unknown broker", []string{"relay", "--broker", "carrier-pigeon"}, `unknown broker "carrier-pigeon"`},
		{"long table name", []string{"migrate", "--table", strings.Repeat("t", 48)}, "table"},
		{"no database", []string{"migrate", "--database-url", ""}, "database_url: is empty"},
		{"unreachable database", []string{"migrate"}, "connect to database"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv("DATABASE_URL", dsn)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			_, _, err := runCLI(ctx, c.args...)
			if err == nil {
				t.Fatal("no error")
			}
			msg := err.Error()
			if !strings.Contains(msg, c.want) {
				t.Errorf("error %q does not name %q", msg, c.want)
			}
			// One problem, one short message: no usage text, no dump.
			if n := strings.Count(msg, "\n"); n > 3 {
				t.Errorf("error has %d lines, want a short one:\n%s", n+1, msg)
			}
		})
	}
}

// A payload the producer rejects is refused with a clear error before
// anything is sent, and leaves what committed before it intact.
func TestBadPayloadLosesNothingCommitted(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	ctx := context.Background()
	w, err := outbox.NewWriter(outbox.WriterOptions{Store: cfg, MaxPayloadBytes: 64})
	if err != nil {
		t.Fatal(err)
	}
	agg := uuid.NewString()
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return w.Write(ctx, tx, outbox.Message{AggregateID: agg, Type: "order.placed", Payload: map[string]int{"n": 1}})
	}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name    string
		payload any
		want    string
	}{
		{"not JSON", []byte("{not json"), "payload is not valid JSON"},
		{"over the limit", []byte(`"` + strings.Repeat("x", 100) + `"`), "payload is 102 bytes, over the limit of 64"},
	} {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			return w.Write(ctx, tx, outbox.Message{AggregateID: agg, Type: "order.paid", Payload: c.payload})
		})
		var ve *outbox.ValidationError
		if !errors.As(err, &ve) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: error %v, want a validation error saying %q", c.name, err, c.want)
		}
	}
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{cfg.Schema, "events_outbox"}.Sanitize()+" WHERE aggregate_id = $1", agg).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 1 {
		t.Errorf("%d events for the aggregate, want the 1 committed", n)
	}
}

// A consumed message without the relay's identity header is named as such.
func TestMissingEventIdentityIsNamed(t *testing.T) {
	msg := message.NewMessage(uuid.NewString(), []byte(`{}`))
	_, err := dedupe.EventID(msg)
	if !errors.Is(err, dedupe.ErrNoEventID) || !strings.Contains(err.Error(), `"event_id" is missing`) {
		t.Errorf("error %v does not name the missing event_id header", err)
	}
}

// TLS to PostgreSQL is set in the URL: with sslmode=verify-full the relay
// connects only to a server whose certificate the named CA signed.
func TestDatabaseTLSFromURL(t *testing.T) {
	admin := pgtest.NewPool(t)
	ctx := context.Background()
	var dataDir string
	if err := admin.QueryRow(ctx, "SHOW data_directory").Scan(&dataDir); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(dataDir)
	if err != nil || unix.Access(dataDir, unix.W_OK) != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("cannot write to the server's data directory %s to install a certificate: %v", dataDir, err)
		}
		t.Skipf("cannot write to the server's data directory %s to install a certificate", dataDir)
	}
	dir := t.TempDir()
	caPEM, certPEM, keyPEM := testCertificates(t)
	otherCA, _, _ := testCertificates(t)
	certFile, keyFile := filepath.Join(dataDir, "outbox-test-server.crt"), filepath.Join(dataDir, "outbox-test-server.key")
	for path, b := range map[string][]byte{certFile: certPEM, keyFile: keyPEM} {
		if err := os.WriteFile(path, b, 0o600); err != nil {
			t.Fatal(err)
		}
		// The server reads them as the data directory's owner.
		owner := st.Sys().(*syscall.Stat_t)
		if err := os.Chown(path, int(owner.Uid), int(owner.Gid)); err != nil {
			t.Fatal(err)
		}
	}
	caFile, otherCAFile := filepath.Join(dir, "ca.pem"), filepath.Join(dir, "other-ca.pem")
	if err := os.WriteFile(caFile, caPEM, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(otherCAFile, otherCA, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{
		"ALTER SYSTEM SET ssl_cert_file = '" + certFile + "'",
		"ALTER SYSTEM SET ssl_key_file = '" + keyFile + "'",
		"ALTER SYSTEM SET ssl = on",
		"SELECT pg_reload_conf()",
	} {
		if _, err := admin.Exec(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for _, s := range []string{"ALTER SYSTEM RESET ssl", "ALTER SYSTEM RESET ssl_cert_file", "ALTER SYSTEM RESET ssl_key_file", "SELECT pg_reload_conf()"} {
			if _, err := admin.Exec(context.Background(), s); err != nil {
				t.Logf("%s: %v", s, err)
			}
		}
		_ = os.Remove(certFile)
		_ = os.Remove(keyFile)
	})

	password := "Pw-" + randomHex(8)
	role, roleURL := passwordRole(t, password)
	schema := "sec_" + randomHex(4)
	if err := ownSchema(ctx, admin, schema, role); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = admin.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE") })
	withTLS := func(ca string) string {
		u := *roleURL
		u.User = url.UserPassword(role, password)
		q := u.Query()
		q.Set("sslmode", "verify-full")
		q.Set("sslrootcert", ca)
		u.RawQuery = q.Encode()
		return u.String()
	}
	// The reload is asynchronous: wait for the server to offer TLS.
	deadline := time.Now().Add(10 * time.Second)
	for {
		t.Setenv("DATABASE_URL", withTLS(caFile))
		_, errOut, err := runCLI(ctx, "migrate", "--schema", schema)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("migrate over verified TLS: %v\n%s", err, errOut)
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Setenv("DATABASE_URL", withTLS(otherCAFile))
	out, errOut, err := runCLI(ctx, "migrate", "--schema", schema)
	if err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Errorf("a server certificate from an unknown CA was accepted or not named: %v", err)
	}
	if err != nil {
		assertNoSecret(t, []string{password}, "TLS failure", err.Error(), out, errOut)
	}
}

// testCertificates returns a new CA and a server certificate it signed for
// 127.0.0.1 and localhost, in PEM.
func testCertificates(t *testing.T) (caPEM, certPEM, keyPEM []byte) {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	ca := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "outbox test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	leaf := &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "localhost"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		DNSNames: []string{"localhost"}, IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, leaf, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}),
		pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})
}
