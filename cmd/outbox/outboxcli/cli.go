// Package outboxcli is the outbox command line: `outbox migrate`, `outbox relay`,
// `outbox demo` and the operator commands. cmd/outbox is a thin main over
// it, so a team can build the same binary with publishers of its own:
//
//	import _ "example.com/team/mybroker" // calls brokers.Register
//	func main() { os.Exit(outboxcli.Main(context.Background(), os.Args[1:])) }
package outboxcli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/metrics"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/migrate"
	"github.com/outboxhq/outbox/store/table"
)

// Main runs the command line with args (without the program name) and
// returns the exit code (see ExitCode). SIGINT and SIGTERM stop it
// gracefully.
func Main(ctx context.Context, args []string) int {
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	root, m := newRoot(os.Stdout, os.Stderr)
	root.SetArgs(args)
	if err := root.ExecuteContext(ctx); err != nil {
		// Errors of the commands are masked already; those of cobra's
		// argument parsing are not.
		if !errors.Is(err, errNoMatch) {
			fmt.Fprintln(os.Stderr, "outbox:", m.mask(err.Error()))
		}
		return ExitCode(err)
	}
	return ExitOK
}

// NewRoot returns the root command writing to out and errOut. Whatever
// its commands write or return has its credentials masked (see Redact).
func NewRoot(out, errOut io.Writer) *cobra.Command {
	root, _ := newRoot(out, errOut)
	return root
}

func newRoot(out, errOut io.Writer) (*cobra.Command, *masker) {
	m := &masker{}
	m.add(environSecrets(os.Environ())...)
	root := &cobra.Command{
		Use:   "outbox",
		Short: "Transactional outbox relay for PostgreSQL",
		Long: "outbox relays events committed to a PostgreSQL outbox table to a broker, and runs the\n" +
			"operator commands around it.\n\n" + exitCodesHelp,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.SetOut(m.writer(out))
	root.SetErr(m.writer(errOut))
	AddGlobalFlags(root.PersistentFlags())
	root.AddCommand(migrateCmd(), relayCmd(), demoCmd())
	for _, c := range extraCommands {
		root.AddCommand(c())
	}
	for _, c := range root.Commands() {
		long := c.Long
		if long == "" {
			long = c.Short
		}
		c.Long = long + "\n\n" + exitCodesHelp
	}
	maskCommands(root, m)
	classifyCommands(root)
	return root, m
}

// extraCommands are added by other files of this package.
var extraCommands []func() *cobra.Command

// app is the parsed configuration and what it opens, for one command.
type app struct {
	cfg    *Config
	loader *Loader
	log    *slog.Logger
	out    io.Writer
	mask   *masker         // of the command line's output, which the log and out go through
	slots  *slotMetrics    // the slot's gauges, when relay.mode log serves /metrics
	poller *metrics.Poller // the backlog gauges, when the relay serves /metrics
	stops  []func(context.Context)
	// logReady is the log relay's readiness checks once relay.mode log runs.
	logReady atomic.Pointer[func() []core.Check]
}

// onStop runs fn when the command's work has stopped (see stopped), such
// as to flush buffered spans.
func (e *app) onStop(fn func(context.Context)) { e.stops = append(e.stops, fn) }

// stopped runs the functions of onStop, last added first.
func (e *app) stopped(ctx context.Context) {
	for i := len(e.stops) - 1; i >= 0; i-- {
		e.stops[i](ctx)
	}
	e.stops = nil
}

// setup loads the configuration and hands its secrets to the command
// line's masker before anything is logged.
func setup(cmd *cobra.Command) (*app, error) {
	m := commandMasker(cmd)
	environ := os.Environ()
	m.add(environSecrets(environ)...)
	cfg, loader, err := Load(cmd.Flags(), environ)
	if err != nil {
		return nil, usageError(err)
	}
	m.add(secretsOf(loader.k)...)
	if err := cfg.Validate(); err != nil {
		return nil, usagef("invalid configuration:\n%w", err)
	}
	return &app{cfg: cfg, loader: loader, log: newLogger(cmd.ErrOrStderr(), cfg.Log), out: cmd.OutOrStdout(), mask: m}, nil
}

func newLogger(w io.Writer, c LogConfig) *slog.Logger {
	var lvl slog.Level
	_ = lvl.UnmarshalText([]byte(c.Level))
	opts := &slog.HandlerOptions{Level: lvl}
	if c.Format == "json" {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

// openPool connects to the database. The URL is only ever printed
// redacted, and the password pgx settled on (from the URL, PGPASSWORD or
// a password file) joins the masked secrets.
func (e *app) openPool(ctx context.Context, appName string) (*pgxpool.Pool, error) {
	pool, err := e.newPool(ctx, appName, 0)
	if err != nil {
		return nil, err
	}
	// Creating the pool under a short-lived context made later queries fail
	// with that context's deadline, so only the first ping is bounded.
	cctx, cancel := context.WithTimeout(ctx, connectTimeout)
	err = pool.Ping(cctx)
	cancel()
	if err != nil {
		pool.Close()
		return nil, unavailable(fmt.Errorf("connect to database %s: %w", Redact(e.cfg.DatabaseURL), err))
	}
	return pool, nil
}

// newPool is openPool without connecting: the pool connects on first use,
// and keeps warm connections open from the start (in the background).
func (e *app) newPool(ctx context.Context, appName string, warm int32) (*pgxpool.Pool, error) {
	pc, err := pgxpool.ParseConfig(e.cfg.DatabaseURL)
	if err != nil {
		return nil, usagef("database_url: %w", err)
	}
	e.mask.add(pc.ConnConfig.Password)
	pc.MaxConns = e.cfg.Database.MaxConns
	pc.MinConns = min(warm, pc.MaxConns)
	pc.ConnConfig.RuntimeParams["application_name"] = appName
	if t := e.cfg.Database.IdleInTransactionTimeout; t > 0 {
		pc.ConnConfig.RuntimeParams["idle_in_transaction_session_timeout"] = strconv.FormatInt(t.Milliseconds(), 10)
	}
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, usagef("database_url: %w", err)
	}
	return pool, nil
}

// openStore connects, checks that the schema is migrated and returns the
// store; closing st.Pool() releases it.
func (e *app) openStore(ctx context.Context, appName string) (*table.Source, error) {
	pool, err := e.openPool(ctx, appName)
	if err != nil {
		return nil, err
	}
	if err := migrate.CheckSchema(ctx, pool, e.cfg.StoreConfig()); err != nil {
		pool.Close()
		return nil, err
	}
	st, err := table.New(pool, e.cfg.StoreConfig(), e.log)
	if err != nil {
		pool.Close()
		return nil, err
	}
	return st, nil
}

func migrateCmd() *cobra.Command {
	var printSQL, all bool
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Create or upgrade the outbox tables",
		Long: "migrate applies the migrations the schema does not have yet, step by step, while producers\n" +
			"go on writing: no step holds a lock that blocks their INSERTs for longer than a lock_timeout\n" +
			"(500ms, retried with backoff) plus a catalog change. Each step is recorded as it completes, so a\n" +
			"migrate that was stopped resumes where it stopped; concurrent runs wait for each other.\n\n" +
			"With --print it changes nothing and prints them instead, as SQL for a DBA to apply with psql in\n" +
			"its default autocommit mode, with the configured schema and table names filled in: the statements\n" +
			"that create the schema and the migrations table if missing, then each step, in a transaction or\n" +
			"outside one as it must run, each statement with the lock it takes, and the INSERT that records\n" +
			"the step, so that outbox sees the schema as migrated afterwards. --print reads the database's\n" +
			"progress to leave out what is applied; --print --all prints every migration and needs no database.",
		Example: "  outbox migrate\n" +
			"  outbox migrate --print > outbox.sql\n" +
			"  outbox migrate --print --all --schema billing",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if all && !printSQL {
				return usagef("--all goes with --print")
			}
			if printSQL && all {
				cfg, l, err := Load(cmd.Flags(), os.Environ())
				if err != nil {
					return usageError(err)
				}
				commandMasker(cmd).add(secretsOf(l.k)...)
				return printMigrations(cmd.OutOrStdout(), cfg.StoreConfig(), 0, 0, 0)
			}
			e, err := setup(cmd)
			if err != nil {
				return err
			}
			pool, err := e.openPool(cmd.Context(), "outbox-migrate")
			if err != nil {
				return err
			}
			defer pool.Close()
			if printSQL {
				have, partial, steps, err := migrate.SchemaProgress(cmd.Context(), pool, e.cfg.StoreConfig())
				if err != nil {
					return err
				}
				return printMigrations(e.out, e.cfg.StoreConfig(), have, partial, steps)
			}
			applied, err := migrate.MigrateWith(cmd.Context(), pool, e.cfg.StoreConfig(), migrate.Options{Log: e.log})
			if err != nil {
				return err
			}
			sc, _ := e.cfg.StoreConfig().WithDefaults()
			if len(applied) == 0 {
				fmt.Fprintf(e.out, "schema %s.%s is up to date\n", sc.Schema, sc.Table)
				return nil
			}
			fmt.Fprintf(e.out, "applied migrations %v to %s.%s\n", applied, sc.Schema, sc.Table)
			return nil
		},
	}
	f := cmd.Flags()
	f.BoolVar(&printSQL, "print", false, "print the SQL of the migrations not yet applied instead of applying them")
	f.BoolVar(&all, "all", false, "with --print: every migration, without connecting to the database")
	return cmd
}

// commentName is schema.table for an SQL comment, quoted when a name holds
// anything that could end the comment.
func commentName(sc store.Config) string {
	name := sc.Schema + "." + sc.Table
	if strings.ContainsFunc(name, func(r rune) bool { return r < ' ' || r == 0x7f }) {
		return strconv.Quote(name)
	}
	return name
}

// printMigrations writes, as one psql script, the migrations after
// version have, each step as Migrate runs it with the statement that
// records it; of migration partial, only the steps after the first steps.
func printMigrations(w io.Writer, cfg store.Config, have, partial, steps int) error {
	sc, err := cfg.WithDefaults()
	if err != nil {
		return usageError(err)
	}
	migs, err := migrate.Migrations(sc)
	if err != nil {
		return err
	}
	setup, err := migrate.MigrationSetupSQL(sc)
	if err != nil {
		return err
	}
	var pending []migrate.Migration
	for _, m := range migs {
		if m.Version > have {
			pending = append(pending, m)
		}
	}
	if len(pending) == 0 {
		_, err := fmt.Fprintf(w, "-- schema %s is up to date at version %d: nothing to apply\n", commentName(sc), have)
		return err
	}
	fmt.Fprintf(w, "-- outbox migrations %d to %d for %s\n", pending[0].Version, pending[len(pending)-1].Version, commentName(sc))
	fmt.Fprintln(w, "-- Run with psql in autocommit mode (not --single-transaction): some steps run outside a")
	fmt.Fprintln(w, "-- transaction. A step whose lock blocks producers sets lock_timeout; if it fails with")
	fmt.Fprintln(w, "-- \"canceling statement due to lock timeout\", print the script again with --print (it leaves")
	fmt.Fprintln(w, "-- out the steps recorded as done) and run that.")
	fmt.Fprintln(w, `\set ON_ERROR_STOP on`)
	for _, s := range setup {
		fmt.Fprintf(w, "%s;\n", s)
	}
	for _, m := range pending {
		for i, st := range m.Steps {
			if m.Version == partial && i < steps {
				continue
			}
			rec, err := migrate.MigrationStepRecordSQL(sc, m, i)
			if err != nil {
				return err
			}
			fmt.Fprintf(w, "\n-- %04d_%s step %d of %d, %s\n", m.Version, m.Name, i+1, len(m.Steps), st.Kind)
			switch st.Kind {
			case migrate.StepTx:
				fmt.Fprintln(w, "BEGIN;")
				if st.BlocksWrites() {
					fmt.Fprintf(w, "SET LOCAL lock_timeout = '%dms';\n", migrate.DefaultLockTimeout.Milliseconds())
				}
				for _, x := range st.Statements {
					fmt.Fprintf(w, "-- lock: %s\n%s;\n", x.Lock, x.SQL)
				}
				fmt.Fprintf(w, "%s;\nCOMMIT;\n", rec)
			case migrate.StepBatch:
				do, err := migrate.BatchSQL(sc, st, migrate.DefaultBatchRows)
				if err != nil {
					return err
				}
				fmt.Fprintf(w, "-- lock: %s\n%s;\n%s;\n", st.Statements[0].Lock, do, rec)
			default:
				fmt.Fprintf(w, "-- lock: %s\n%s;\n%s;\n", st.Statements[0].Lock, st.Statements[0].SQL, rec)
			}
		}
	}
	return nil
}
