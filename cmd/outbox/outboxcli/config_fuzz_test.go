package outboxcli

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/spf13/pflag"

	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/migrate"
)

// fuzzSecret is the password of the database URL every fuzzed load sees; no
// error may repeat it.
const fuzzSecret = "FuzzSecret-7f3a9c"

// FuzzLoadConfig feeds arbitrary YAML and one arbitrary environment variable
// to the configuration loader. Whatever the input: no panic, no error that
// repeats the database password, and a configuration that validates yields
// SQL in which every configured name is quoted.
func FuzzLoadConfig(f *testing.F) {
	f.Add("broker: stdout\n", "OUTBOX_RELAY_BATCH_SIZE", "100")
	f.Add("store:\n  schema: 'a\"b'\n  table: \"t; DROP TABLE x; --\"\n", "OUTBOX_STORE_NOTIFY_CHANNEL", "c'--")
	f.Add("relay:\n  batch_size: 0\n  poll_interval: -1s\n", "OUTBOX_LOG_LEVEL", "loud")
	f.Add("routing:\n  types:\n    a.b: ''\n  prefixes:\n    '': x\n", "OUTBOX_ROUTING_TOPIC", "t")
	f.Add("database_url: postgres://u:other@h/db\n", "DATABASE_URL", "mysql://u@h/db")
	f.Add("brokers:\n  stdout:\n    x: 1\n", "OUTBOX_BROKERS_STDOUT_X", "2")
	f.Add("relay: [1, 2\n", "", "")
	f.Add("database:\n  idle_in_transaction_timeout: 1s\nrelay:\n  publish_timeout: 2s\n", "OUTBOX_DATABASE_MAX_CONNS", "1")
	f.Fuzz(func(t *testing.T, yamlText, envName, envValue string) {
		if len(yamlText) > 4096 || len(envName) > 256 || len(envValue) > 1024 {
			t.Skip()
		}
		if strings.ContainsAny(envName, "=\x00") {
			t.Skip() // not a variable name an environment can hold
		}
		path := filepath.Join(t.TempDir(), "outbox.yaml")
		if err := os.WriteFile(path, []byte(yamlText), 0o600); err != nil {
			t.Fatal(err)
		}
		fs := pflag.NewFlagSet("fuzz", pflag.ContinueOnError)
		AddFlags(fs)
		if err := fs.Parse([]string{"--config", path}); err != nil {
			t.Fatal(err)
		}
		environ := []string{"DATABASE_URL=postgres://outbox:" + fuzzSecret + "@127.0.0.1:5432/outbox"}
		if envName != "" {
			environ = append(environ, envName+"="+envValue)
		}
		echoes := strings.Contains(yamlText+envValue, fuzzSecret)
		cfg, _, err := Load(fs, environ)
		if err != nil {
			if !echoes && strings.Contains(err.Error(), fuzzSecret) {
				t.Fatalf("load error repeats the database password: %v", err)
			}
			return
		}
		if err := cfg.Validate(); err != nil {
			if !echoes && strings.Contains(err.Error(), fuzzSecret) {
				t.Fatalf("validation error repeats the database password: %v", err)
			}
			return
		}
		checkQuotedSQL(t, cfg.StoreConfig())
	})
}

// checkQuotedSQL renders the migrations and grants of a valid store
// configuration and fails if a configured name appears in them other than
// as a correctly quoted identifier.
func checkQuotedSQL(t *testing.T, sc store.Config) {
	t.Helper()
	sc, err := sc.WithDefaults()
	if err != nil {
		t.Fatalf("validated store config rejected: %v", err)
	}
	migs, err := migrate.Migrations(sc)
	if err != nil {
		t.Fatalf("migrations for a validated config: %v", err)
	}
	role := "r" + sc.Table // any name
	grants, err := migrate.Grants(sc, migrate.Roles{Relay: role, Producer: role, Consumer: role})
	if err != nil {
		t.Fatalf("grants for a validated config: %v", err)
	}
	var sql []string
	for _, m := range migs {
		sql = append(sql, m.SQL)
	}
	sql = append(sql, grants...)

	// Longest first, so a schema-qualified name goes before its parts.
	literal := func(v string) string { return "E'" + strings.NewReplacer(`\`, `\\`, "'", "''").Replace(v) + "'" }
	quoted := []string{
		// Migration 9's literals: the message prefix, the schema and table.
		literal("outbox:" + sc.Schema + "." + sc.Table),
		literal("outbox-wake:" + sc.Schema + "." + sc.Table), // migration 12's wake-up key
		literal(sc.Schema),
		literal(sc.Table),
		pgx.Identifier{sc.Schema, sc.Table + "_log_write"}.Sanitize(),
		pgx.Identifier{sc.Schema, sc.Table + "_migrations"}.Sanitize(),
		pgx.Identifier{sc.Schema, sc.Table + "_log_slot"}.Sanitize(),
		pgx.Identifier{sc.Schema, sc.Table + "_id_seq"}.Sanitize(),
		pgx.Identifier{sc.Schema, sc.ProcessedTable}.Sanitize(),
		pgx.Identifier{sc.Schema, sc.Table + "_uuidv7"}.Sanitize(),
		pgx.Identifier{sc.Schema, sc.Table + "_notify"}.Sanitize(),
		pgx.Identifier{sc.Schema, sc.Table + "_handoff"}.Sanitize(),
		pgx.Identifier{sc.Schema, sc.Table + "_schedule"}.Sanitize(),
		pgx.Identifier{sc.Schema, sc.Table + "_write"}.Sanitize(),
		pgx.Identifier{sc.Schema, sc.Table + "_check_row"}.Sanitize(),
		pgx.Identifier{sc.Schema, sc.Table + "_key_sync"}.Sanitize(),
		pgx.Identifier{sc.Schema, sc.Table}.Sanitize(),
		pgx.Identifier{sc.Table + "_reserved_check"}.Sanitize(),
		pgx.Identifier{sc.Table + "_row_check"}.Sanitize(),
		pgx.Identifier{sc.Table + "_deliver_check"}.Sanitize(),
		pgx.Identifier{sc.Table + "_payload_check"}.Sanitize(),
		pgx.Identifier{sc.Table + "_ctype_check"}.Sanitize(),
		pgx.Identifier{sc.Table + "_topic_check"}.Sanitize(),
		pgx.Identifier{sc.Table + "_key_check"}.Sanitize(),
		pgx.Identifier{sc.Table + "_schedule"}.Sanitize(),
		pgx.Identifier{sc.Table + "_headers_check"}.Sanitize(),
		pgx.Identifier{sc.Table + "_type_check"}.Sanitize(),
		pgx.Identifier{sc.Table + "_notify"}.Sanitize(),
		pgx.Identifier{sc.Table + "_uid"}.Sanitize(),
		pgx.Identifier{sc.Table + "_handoff_agg"}.Sanitize(),
		pgx.Identifier{sc.Table + "_pending_part"}.Sanitize(),
		pgx.Identifier{sc.Table + "_pending_agg"}.Sanitize(),
		pgx.Identifier{sc.Table + "_retrying"}.Sanitize(),
		pgx.Identifier{sc.Table + "_pending"}.Sanitize(),
		pgx.Identifier{sc.Table + "_failed"}.Sanitize(),
		pgx.Identifier{sc.Table + "_key_sync"}.Sanitize(),
		pgx.Identifier{sc.Table + "_key_notnull"}.Sanitize(),
		pgx.Identifier{sc.Table + "_agg_new"}.Sanitize(),
		pgx.Identifier{sc.Table + "_retry_new"}.Sanitize(),
		pgx.Identifier{autoIndexName(sc.Table, "dispatched_at")}.Sanitize(),
		pgx.Identifier{autoIndexName(sc.Table, "id")}.Sanitize(),
		pgx.Identifier{sc.ProcessedTable + "_at"}.Sanitize(),
		pgx.Identifier{sc.Schema}.Sanitize(),
		pgx.Identifier{role}.Sanitize(),
		// Literals that hold double quotes: the header check's path, the
		// row check's message, a collation and the notify channel (its quoting is tested against a server).
		`'$.* ? (@.type() != "string")'`,
		`'new row for relation "%" violates check constraint "%": %'`, // migration 12's error, as PostgreSQL words it
		`COLLATE "C"`, // migration 7's byte-wise key column
		"E'" + strings.NewReplacer(`\`, `\\`, "'", "''").Replace(sc.NotifyChannel) + "'",
	}
	for _, s := range sql {
		rest := s
		for _, q := range quoted {
			rest = strings.ReplaceAll(rest, q, " ")
		}
		// A name spliced in unquoted, or quoted wrongly, leaves a quote.
		if strings.Contains(rest, `"`) {
			t.Fatalf("a quote outside the quoted names: the SQL\n%s\nleaves\n%s", s, rest)
		}
	}
}

// autoIndexName is the name PostgreSQL gives an index on table (column)
// when none is given, the longer part clipped first to fit 63 bytes:
// migrations 2 and 3 name their indexes so.
func autoIndexName(table, column string) string {
	t, c := len(table), len(column)
	for t+c > 63-len("_idx")-1 {
		if t > c {
			t--
		} else {
			c--
		}
	}
	for t > 0 && t < len(table) && !utf8.RuneStart(table[t]) {
		t--
	}
	return table[:t] + "_" + column[:c] + "_idx"
}
