package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"runtime/pprof"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	_ "github.com/outboxhq/outbox/brokers/stdout"
	"github.com/outboxhq/outbox/cmd/outbox/outboxcli"
)

// With -steady-profile, this build's relay in the steady rows runs inside
// this program (the `outbox` command line, the same code as the binary)
// under a CPU profile, and the relay's SQL is read from
// pg_stat_statements when the server has it loaded.

const profiledCommand = "outbox-profiled"

// runProfiled is `outbox-bench outbox-profiled <profile> <outbox args>`:
// the outbox command line with a CPU profile of the whole run.
func runProfiled(args []string) int {
	if len(args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: outbox-bench", profiledCommand, "<cpu profile> <outbox arguments>")
		return 2
	}
	f, err := os.Create(args[0])
	if err != nil {
		fmt.Fprintln(os.Stderr, "create profile:", err)
		return 1
	}
	defer f.Close()
	if err := pprof.StartCPUProfile(f); err != nil {
		fmt.Fprintln(os.Stderr, "start profile:", err)
		return 1
	}
	code := outboxcli.Main(context.Background(), args[1:])
	pprof.StopCPUProfile()
	return code
}

// profileArgv is how the steady row named row starts this build's relay
// number i: the binary, or this program under a profile.
func (b *bench) profileArgv(v steadyVersion, row string, i int) ([]string, error) {
	if v.Label != thisBuild || b.cfg.SteadyProfile == "" {
		return []string{v.bin}, nil
	}
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("find own executable: %w", err)
	}
	if err := os.MkdirAll(b.cfg.SteadyProfile, 0o755); err != nil {
		return nil, fmt.Errorf("profile directory: %w", err)
	}
	return []string{exe, profiledCommand, filepath.Join(b.cfg.SteadyProfile, fmt.Sprintf("%s-%d.pprof", row, i))}, nil
}

var unsafeName = regexp.MustCompile(`[^a-z0-9]+`)

// profileName names a steady row's files.
func profileName(c steadyCase) string {
	return strings.Trim(unsafeName.ReplaceAllString(strings.ToLower(fmt.Sprintf("%s-%s-%drelays-%d", c.kind, c.path, c.relays, c.rate)), "-"), "-")
}

// statements resets pg_stat_statements; report writes, per event, what
// the statements of schema cost over the window since. Both do nothing
// without -steady-profile or the extension.
type statements struct {
	b      *bench
	on     bool
	schema string
}

func (b *bench) watchStatements(ctx context.Context, schema string) *statements {
	s := &statements{b: b, schema: schema}
	if b.cfg.SteadyProfile == "" {
		return s
	}
	if _, err := b.pool.Exec(ctx, `CREATE EXTENSION IF NOT EXISTS pg_stat_statements`); err != nil {
		b.log.Info("no pg_stat_statements", "error", err)
		return s
	}
	if _, err := b.pool.Exec(ctx, `SELECT pg_stat_statements_reset()`); err != nil {
		b.log.Info("no pg_stat_statements", "error", err)
		return s
	}
	s.on = true
	return s
}

func (s *statements) report(ctx context.Context, row string, events int64, window time.Duration) {
	if !s.on || events == 0 {
		return
	}
	rows, err := s.b.pool.Query(ctx, `SELECT calls, total_exec_time, rows, regexp_replace(left(query, 160), '\s+', ' ', 'g')
FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND query NOT LIKE '%pg_stat_statements%' AND query NOT LIKE 'INSERT INTO ' || $1 || '%' AND query NOT LIKE '%pg_logical_emit_message%'
ORDER BY total_exec_time DESC LIMIT 25`, pgx.Identifier{s.schema}.Sanitize())
	if err != nil {
		s.b.log.Warn("read pg_stat_statements", "error", err)
		return
	}
	var out strings.Builder
	fmt.Fprintf(&out, "%d events over %s; per event: calls, server time (us), rows; then the statement\n", events, window.Round(time.Millisecond))
	var total float64
	for rows.Next() {
		var calls, nrows int64
		var ms float64
		var q string
		if err := rows.Scan(&calls, &ms, &nrows, &q); err != nil {
			s.b.log.Warn("read pg_stat_statements", "error", err)
			return
		}
		total += ms
		fmt.Fprintf(&out, "%6.3f %8.1f %6.2f  %s\n", float64(calls)/float64(events), ms*1e3/float64(events), float64(nrows)/float64(events), q)
	}
	fmt.Fprintf(&out, "total server time of these statements: %.1f us per event\n", total*1e3/float64(events))
	path := filepath.Join(s.b.cfg.SteadyProfile, row+".sql.txt")
	if err := os.WriteFile(path, []byte(out.String()), 0o644); err != nil {
		s.b.log.Warn("write statements", "error", err)
	}
}
