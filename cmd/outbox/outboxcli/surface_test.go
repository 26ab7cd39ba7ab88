package outboxcli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/spf13/pflag"

	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/migrate"
)

var relayOnlyFlags = []string{"--broker", "--batch-size", "--lanes", "--unordered", "--mode", "--no-wakeups", "--http-listen"}

func TestCommandsShowOnlyTheirFlags(t *testing.T) {
	ctx := context.Background()
	for _, c := range NewRoot(nil, nil).Commands() {
		name := c.Name()
		if name == "help" || name == "completion" {
			continue
		}
		t.Run(name, func(t *testing.T) {
			out, _, err := runCLI(ctx, name, "--help")
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(out, "Exit codes:") || !strings.Contains(out, "4  nothing matched") {
				t.Errorf("%s --help does not list the exit codes\n%s", name, out)
			}
			for _, f := range relayOnlyFlags {
				// The console serves on the same address as the relay.
				want := name == "relay" || (name == "console" && f == "--http-listen")
				if has := listsFlag(out, f); has != want {
					t.Errorf("%s --help lists %s: %v\n%s", name, f, has, out)
				}
			}
			for _, f := range []string{"--config", "--database-url", "--schema", "--table", "--log-level", "--log-format"} {
				if !listsFlag(out, f) {
					t.Errorf("%s --help lacks the global flag %s\n%s", name, f, out)
				}
			}
		})
	}
	out, _, err := runCLI(ctx, "migrate", "--help")
	if err != nil || !strings.Contains(out, "--print") || !strings.Contains(out, "--all") {
		t.Errorf("migrate --help lacks --print or --all (err %v):\n%s", err, out)
	}
	_, _, err = runCLI(ctx, "status", "--batch-size", "10")
	if err == nil || !strings.Contains(err.Error(), "batch-size") || ExitCode(err) != ExitUsage {
		t.Errorf("status --batch-size: err = %v (code %d), want an unknown flag, code %d", err, ExitCode(err), ExitUsage)
	}
}

// listsFlag reports whether the help text lists flag: followed by its type
// or, for a boolean, its optional value.
func listsFlag(help, flag string) bool {
	return strings.Contains(help, flag+" ") || strings.Contains(help, flag+"[")
}

func TestLoadWithTheGlobalFlagsOnly(t *testing.T) {
	fs := pflag.NewFlagSet("status", pflag.ContinueOnError)
	AddGlobalFlags(fs)
	if err := fs.Parse([]string{"--database-url", "postgres://flag/db", "--schema", "s1", "--log-level", "debug"}); err != nil {
		t.Fatal(err)
	}
	c, _, err := Load(fs, []string{"OUTBOX_RELAY_LANES=7", "OUTBOX_BROKER=gochannel"})
	if err != nil {
		t.Fatal(err)
	}
	if c.DatabaseURL != "postgres://flag/db" || c.Store.Schema != "s1" || c.Log.Level != "debug" {
		t.Errorf("flags not applied: %+v", c)
	}
	if c.Relay.Lanes != 7 || c.Broker != "gochannel" || c.Relay.BatchSize != 500 || !c.Relay.Wakeups {
		t.Errorf("relay settings from environment and defaults: %+v %q", c.Relay, c.Broker)
	}
	if err := c.Validate(); err != nil {
		t.Error(err)
	}
	// The relay's flags alone, without --config, load as well.
	rs := pflag.NewFlagSet("relay", pflag.ContinueOnError)
	AddRelayFlags(rs)
	if err := rs.Parse([]string{"--no-wakeups", "--lanes", "3"}); err != nil {
		t.Fatal(err)
	}
	if c, _, err = Load(rs, nil); err != nil || c.Relay.Wakeups || c.Relay.Lanes != 3 {
		t.Errorf("relay flags only: %+v, %v", c, err)
	}
}

func TestBuildVersion(t *testing.T) {
	bi := &debug.BuildInfo{GoVersion: "go1.99.1", Main: debug.Module{Path: "github.com/outboxhq/outbox", Version: "v1.2.3"},
		Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "abc123"}, {Key: "vcs.modified", Value: "true"},
			{Key: "vcs.time", Value: "2026-01-02T03:04:05Z"}}}
	v := buildVersion("", bi, true)
	want := versionJSON{Module: "github.com/outboxhq/outbox", Version: "v1.2.3", Commit: "abc123", CommitAt: "2026-01-02T03:04:05Z",
		Modified: "true", GoVersion: "go1.99.1"}
	if v != want {
		t.Errorf("buildVersion = %+v, want %+v", v, want)
	}
	if s := v.String(); s != "outbox v1.2.3, commit abc123 (modified) of 2026-01-02T03:04:05Z, go1.99.1" {
		t.Errorf("String() = %q", s)
	}
	if v := buildVersion("", nil, false); v.Version != "unknown" || !strings.HasPrefix(v.GoVersion, "go") {
		t.Errorf("without build info: %+v", v)
	}
	// The version set at build time wins over the module's "(devel)".
	devel := &debug.BuildInfo{Main: debug.Module{Path: "github.com/outboxhq/outbox", Version: "(devel)"}}
	if v := buildVersion("v0.1.0", devel, true); v.Version != "v0.1.0" {
		t.Errorf("with -ldflags version: %+v", v)
	}
	// Without VCS data (-buildvcs=false), whether the tree was modified is
	// unknown, not false.
	b, err := json.Marshal(buildVersion("", devel, true))
	if err != nil || !strings.Contains(string(b), `"modified":"unknown"`) {
		t.Errorf("without VCS data: %s, %v", b, err)
	}
	if b, _ := json.Marshal(want); !strings.Contains(string(b), `"modified":true`) {
		t.Errorf("with VCS data: %s", b)
	}

	out, _, err := runCLI(context.Background(), "version")
	if err != nil || !strings.HasPrefix(out, "outbox ") || !strings.Contains(out, "go1.") {
		t.Errorf("version: %q, %v", out, err)
	}
	out, _, err = runCLI(context.Background(), "version", "--json")
	var j versionJSON
	if err != nil || json.Unmarshal([]byte(out), &j) != nil || j.GoVersion == "" || j.Version == "" {
		t.Errorf("version --json: %q, %v", out, err)
	}
}

func TestMigratePrint(t *testing.T) {
	ctx := context.Background()
	// --all needs no database: this URL reaches nothing.
	t.Setenv("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none?connect_timeout=1")
	out, _, err := runCLI(ctx, "migrate", "--print", "--all", "--schema", "dba_x", "--table", "evts")
	if err != nil {
		t.Fatal(err)
	}
	migs, err := migrate.Migrations(store.Config{Schema: "dba_x", Table: "evts"})
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range migs {
		rec, _ := migrate.MigrationRecordSQL(store.Config{Schema: "dba_x", Table: "evts"}, m)
		if !strings.Contains(out, rec+";") {
			t.Errorf("--print --all lacks %q", rec)
		}
	}
	if !strings.Contains(out, `CREATE TABLE "dba_x"."evts"`) || strings.Contains(out, "{{") {
		t.Errorf("names not filled in:\n%s", out)
	}
	// Every statement comes with the lock it takes, and each step says
	// whether it runs in a transaction; those whose lock blocks producers
	// set lock_timeout.
	for _, want := range []string{
		"-- 0007_producers step 2 of 8, in batches over seq, a transaction each\n-- lock: ROW EXCLUSIVE, producers go on",
		"-- 0002_retention step 1 of 1, outside a transaction\n-- lock: SHARE UPDATE EXCLUSIVE, producers go on (while the index is built)\nCREATE INDEX CONCURRENTLY",
		"-- 0005_event_identity step 1 of 1, in a transaction\nBEGIN;\nSET LOCAL lock_timeout = '500ms';\n-- lock: ACCESS EXCLUSIVE, blocks producers (catalog change only, under lock_timeout)\nALTER TABLE",
		"-- lock: SHARE UPDATE EXCLUSIVE, producers go on (while the rows are checked)\nALTER TABLE \"dba_x\".\"evts\" VALIDATE CONSTRAINT",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("--print --all lacks %q", want)
		}
	}
	stmts := 0
	for _, m := range migs {
		for _, s := range m.Steps {
			stmts += len(s.Statements)
		}
	}
	if n := strings.Count(out, "\n-- lock: "); n != stmts {
		t.Errorf("--print --all names the lock of %d statements, want all %d", n, stmts)
	}
	// A name that could end a comment line is quoted in the script's comments.
	out, _, err = runCLI(ctx, "migrate", "--print", "--all", "--schema", "a\nb")
	if err != nil || !strings.HasPrefix(out, "-- outbox migrations 1 to ") || strings.Contains(strings.Split(out, "\n")[0], "\nb") {
		t.Errorf("schema name with a newline:\n%.300s\n%v", out, err)
	}
	if _, _, err := runCLI(ctx, "migrate", "--all"); ExitCode(err) != ExitUsage {
		t.Errorf("--all without --print: %v", err)
	}

	// Applied by psql, the printed script leaves a schema outbox takes as
	// migrated.
	psql := psqlPath(t)
	admin := pgtest.NewPool(t)
	t.Setenv("DATABASE_URL", pgtest.URL(t))
	schema := "dba_" + randomHex(4)
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	})
	apply := func(script string) {
		t.Helper()
		cmd := exec.CommandContext(ctx, psql, "-X", "-q", "-d", pgtest.URL(t))
		cmd.Stdin = strings.NewReader(script)
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("psql: %v\n%s", err, b)
		}
	}
	// Part of the way: a schema at version 6, then what --print says.
	if _, err := migrate.MigrateWith(ctx, admin, store.Config{Schema: schema}, migrate.Options{To: 6}); err != nil {
		t.Fatal(err)
	}
	out, _, err = runCLI(ctx, "migrate", "--print", "--schema", schema)
	if err != nil {
		t.Fatal(err)
	}
	header := func(m migrate.Migration) string { return fmt.Sprintf("-- %04d_%s step 1 ", m.Version, m.Name) }
	if !strings.Contains(out, header(migs[6])) || strings.Contains(out, header(migs[5])) {
		t.Errorf("migrate --print at version 6:\n%s", out)
	}
	apply(out)
	if err := migrate.CheckSchema(ctx, admin, store.Config{Schema: schema}); err != nil {
		t.Fatal(err)
	}
	if out, _, err := runCLI(ctx, "migrate", "--schema", schema); err != nil || !strings.Contains(out, "up to date") {
		t.Errorf("migrate after the printed script: %q, %v", out, err)
	}
	if out, _, err := runCLI(ctx, "migrate", "--print", "--schema", schema); err != nil || !strings.Contains(out, "nothing to apply") {
		t.Errorf("migrate --print when up to date: %q, %v", out, err)
	}
	// A fresh schema from the whole script.
	fresh := "dba_" + randomHex(4)
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{fresh}.Sanitize()+" CASCADE")
	})
	out, _, err = runCLI(ctx, "migrate", "--print", "--schema", fresh)
	if err != nil {
		t.Fatal(err)
	}
	apply(out)
	if err := migrate.CheckSchema(ctx, admin, store.Config{Schema: fresh}); err != nil {
		t.Fatal(err)
	}
	// A migration stopped midway: only its steps not done are printed.
	last := migs[len(migs)-1]
	for i := len(migs) - 1; len(last.Steps) < 2; i-- {
		last = migs[i-1]
	}
	mt := pgx.Identifier{schema, "events_outbox_migrations"}.Sanitize()
	if _, err := admin.Exec(ctx, "UPDATE "+mt+" SET step = 1 WHERE version = $1", last.Version); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, "DELETE FROM "+mt+" WHERE version > $1", last.Version); err != nil {
		t.Fatal(err)
	}
	out, _, err = runCLI(ctx, "migrate", "--print", "--schema", schema)
	stepTwo := fmt.Sprintf("-- %04d_%s step 2 ", last.Version, last.Name)
	if err != nil || !strings.Contains(out, stepTwo) || strings.Contains(out, header(last)) || strings.Contains(out, header(migs[0])) {
		t.Errorf("migrate --print with migration %d at step 1:\n%s\n%v", last.Version, out, err)
	}
}

// psqlPath finds psql beside the test server's binaries, or on PATH.
func psqlPath(t *testing.T) string {
	t.Helper()
	if dir := os.Getenv("OUTBOX_TEST_PG_BIN"); dir != "" {
		return filepath.Join(dir, "psql")
	}
	p, err := exec.LookPath("psql")
	if err != nil {
		t.Skip("psql not found: applies the printed migrations with it")
	}
	return p
}

func TestExitCodes(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	t.Setenv("DATABASE_URL", pgtest.URL(t))
	ctx := context.Background()
	s := cfg.Schema
	unmigrated := "nomig_" + randomHex(4)
	cases := []struct {
		name string
		env  map[string]string
		args []string
		code int
	}{
		{"ok", nil, []string{"status", "--schema", s}, ExitOK},
		{"unknown command", nil, []string{"frobnicate"}, ExitUsage},
		{"unknown flag", nil, []string{"status", "--nope"}, ExitUsage},
		{"relay flag on status", nil, []string{"status", "--lanes", "2"}, ExitUsage},
		{"extra argument", nil, []string{"status", "now"}, ExitUsage},
		{"bad flag value", nil, []string{"relay", "--lanes", "many"}, ExitUsage},
		{"invalid config", nil, []string{"status", "--log-level", "loud"}, ExitUsage},
		{"unknown key", map[string]string{"OUTBOX_RELAY_BATCHSIZE": "3"}, []string{"status", "--schema", s}, ExitUsage},
		{"bad database url", map[string]string{"DATABASE_URL": "postgres://db.example:port/x"}, []string{"status"}, ExitUsage},
		{"empty selector", nil, []string{"retry", "--schema", s}, ExitUsage},
		{"bad aggregate", nil, []string{"unpark", "--aggregate", strings.Repeat("k", 256), "--schema", s}, ExitUsage},
		{"park without reason", nil, []string{"park", "--type", "x", "--schema", s}, ExitUsage},
		{"bad time", nil, []string{"replay", "--created-after", "yesterday", "--schema", s}, ExitUsage},
		{"bad batch", nil, []string{"cleanup", "--batch", "0", "--schema", s}, ExitUsage},
		{"bad broker section", map[string]string{"OUTBOX_BROKERS_AMQP_CHANNELS": "several"},
			[]string{"relay", "--broker", "amqp", "--schema", s}, ExitUsage},
		{"database unreachable", map[string]string{"DATABASE_URL": "postgres://nobody@127.0.0.1:1/none?connect_timeout=2"},
			[]string{"status"}, ExitUnavailable},
		{"broker unreachable", map[string]string{"OUTBOX_BROKERS_AMQP_URL": "amqp://guest:guest@127.0.0.1:1/",
			"OUTBOX_BROKERS_AMQP_CONNECT_TIMEOUT": "2s", "OUTBOX_RELAY_STARTUP_TIMEOUT": "1s"}, []string{"relay", "--broker", "amqp", "--schema", s}, ExitUnavailable},
		{"not migrated", nil, []string{"status", "--schema", unmigrated}, ExitFailure},
		{"retry matches nothing", nil, []string{"retry", "--type", "no.such", "--schema", s}, ExitNoMatch},
		{"park matches nothing", nil, []string{"park", "--type", "no.such", "--reason", "test", "--schema", s}, ExitNoMatch},
		{"unpark matches nothing", nil, []string{"unpark", "--type", "no.such", "--json", "--schema", s}, ExitNoMatch},
		{"replay matches nothing", nil, []string{"replay", "--type", "no.such", "--dry-run", "--schema", s}, ExitNoMatch},
		{"nothing stuck", nil, []string{"stuck", "--schema", s}, ExitNoMatch},
		{"cleanup deleting nothing is fine", nil, []string{"cleanup", "--schema", s}, ExitOK},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			cctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			defer cancel()
			_, errOut, err := runCLI(cctx, tc.args...)
			if got := ExitCode(err); got != tc.code {
				t.Errorf("%v: exit code %d, want %d (err %v)\n%s", tc.args, got, tc.code, err, errOut)
			}
		})
	}

	// A selection that matches gives 0; stuck lists a held event.
	var id int64
	if err := pool.QueryRow(ctx, "INSERT INTO "+pgx.Identifier{s, "events_outbox"}.Sanitize()+
		" (event_id, aggregate_id, type, payload, retry_at, attempts) VALUES (gen_random_uuid(), gen_random_uuid(), 'x.y', '{}', 'infinity', 3) RETURNING seq").Scan(&id); err != nil {
		t.Fatal(err)
	}
	if out, _, err := runCLI(ctx, "stuck", "--schema", s); err != nil || !strings.HasPrefix(out, "SEQ ") {
		t.Errorf("stuck with a held event: %v\n%s", err, out)
	}
	if out, _, err := runCLI(ctx, "retry", "--type", "x.y", "--schema", s); err != nil || !strings.HasPrefix(out, "released 1 event (") {
		t.Errorf("retry that matches: %v\n%s", err, out)
	}
}

func TestMainMapsExitCodes(t *testing.T) {
	ctx := context.Background()
	if code := Main(ctx, []string{"version"}); code != ExitOK {
		t.Errorf("version: %d", code)
	}
	if code := Main(ctx, []string{"status", "--no-such-flag"}); code != ExitUsage {
		t.Errorf("unknown flag: %d", code)
	}
	t.Setenv("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none?connect_timeout=1")
	if code := Main(ctx, []string{"status"}); code != ExitUnavailable {
		t.Errorf("unreachable database: %d", code)
	}
	if !errors.Is(withCode(ExitFailure, errNoMatch), errNoMatch) || ExitCode(withCode(ExitFailure, errNoMatch)) != ExitNoMatch {
		t.Error("a code once set is kept")
	}
}

// A relay that names no broker refuses to start, naming each way to set
// one, instead of printing its events to stdout and marking them
// dispatched. The database is unreachable: the check comes first.
func TestRelayWithoutBrokerRefusesToStart(t *testing.T) {
	t.Setenv("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none?connect_timeout=1")
	t.Setenv("OUTBOX_BROKER", "")
	os.Unsetenv("OUTBOX_BROKER")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, errOut, err := runCLI(ctx, "relay")
	if got := ExitCode(err); got != ExitUsage {
		t.Fatalf("exit code %d, want %d (err %v)\n%s", got, ExitUsage, err, errOut)
	}
	for _, want := range []string{"broker: not set", "--broker", "OUTBOX_BROKER", "broker in the config file"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	// Named, stdout is accepted: the relay gets as far as the database.
	t.Setenv("OUTBOX_RELAY_STARTUP_TIMEOUT", "1s")
	_, errOut, err = runCLI(ctx, "relay", "--broker", "stdout")
	if got := ExitCode(err); got == ExitUsage {
		t.Errorf("--broker stdout: exit code %d (err %v)\n%s", got, err, errOut)
	}
	// Other commands need no broker.
	if _, errOut, err := runCLI(ctx, "migrate", "--print", "--all"); err != nil {
		t.Errorf("migrate --print --all without a broker: %v\n%s", err, errOut)
	}
}

// The version reaches the binary as make build and the Dockerfile set it,
// and a build without VCS data says "unknown" for modified.
func TestVersionSetAtBuildTime(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	bin := filepath.Join(t.TempDir(), "outbox")
	build := exec.Command("go", "build", "-buildvcs=false",
		"-ldflags", "-X github.com/outboxhq/outbox/cmd/outbox/outboxcli.version=v9.8.7", "-o", bin, "../")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	out, err := exec.Command(bin, "version", "--json").Output()
	if err != nil {
		t.Fatal(err)
	}
	var v map[string]any
	if err := json.Unmarshal(out, &v); err != nil {
		t.Fatal(err)
	}
	if v["version"] != "v9.8.7" || v["modified"] != "unknown" {
		t.Errorf("version --json = %s, want version v9.8.7 and modified unknown", out)
	}
}

// --json belongs to `slot status`, which documents it, not to `slot drop`.
func TestSlotStatusTakesJSON(t *testing.T) {
	t.Setenv("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none?connect_timeout=1")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, errOut, err := runCLI(ctx, "slot", "status", "--json"); ExitCode(err) != ExitUnavailable {
		t.Errorf("slot status --json: exit %d (%v), want %d: the flag parses and the database is unreachable\n%s", ExitCode(err), err, ExitUnavailable, errOut)
	}
	if _, _, err := runCLI(ctx, "slot", "drop", "--json"); ExitCode(err) != ExitUsage {
		t.Errorf("slot drop --json: exit %d (%v), want %d", ExitCode(err), err, ExitUsage)
	}
}
