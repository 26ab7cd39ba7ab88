package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/core/event"
	"github.com/outboxhq/outbox/store"
)

// The steady-state rows: a service writing a trickle of events, one per
// transaction, to relays that keep up. Each row runs the `outbox relay`
// binary of this build and the previous release's, built from its commit
// in the same run, on the same server, one after the other, so a
// regression shows as a ratio. Each version migrates its own schema, and
// producers write plain SQL that every version accepts.

// steadyVersion is one build of the relay binary the rows run.
type steadyVersion struct {
	Label string // "this build", or the baseline's revision
	bin   string
}

const thisBuild = "this build"

// steadyRow is one steady-state measurement of one version.
type steadyRow struct {
	Kind     string // steadyLatency or steadyCPU
	Path     string // the broker of a latency row, the mode of a CPU row
	Relays   int    // relay processes
	Rate     int    // events/s asked of the producers
	Version  string // steadyVersion.Label
	Achieved float64
	Events   int // events committed in the measured window
	Missing  int // of those, not delivered 10s after the last
	P50, P99 time.Duration
	// CPU over the measured window: the relay processes, and the server
	// processes of their sessions (walsender included).
	RelayCPU, DBCPU time.Duration
	// CPU rows: the same, per second of an idle relay before the window
	// (no event written): what a relay costs whatever the rate.
	IdleRelay, IdleDB time.Duration
	Note              string
}

const (
	steadyLatency = "latency"
	steadyCPU     = "cpu"
)

// steadyCase is what one row sets up.
type steadyCase struct {
	kind   string
	path   string
	mode   string // modeTable, modeLog or modeLogOnly
	relays int
	rate   int
	broker *e2eBroker // nil: the stdout broker into a pipe
}

const (
	modeTable   = "table"
	modeLog     = "log"
	modeLogOnly = "log-only"
)

func (b *bench) steadySection(ctx context.Context, rep *report) error {
	if b.cfg.Outbox == "" {
		rep.SteadyNote = "not measured: -outbox names no `outbox` binary (make bench builds bin/outbox)"
		return nil
	}
	versions := []steadyVersion{{Label: thisBuild, bin: b.cfg.Outbox}}
	if base, err := buildBaseline(ctx, b.cfg.BaselineRev); err != nil {
		if ctx.Err() != nil {
			return err
		}
		rep.SteadyNote = "previous release not measured: " + err.Error()
		b.log.Warn("previous release not measured", "error", err)
	} else {
		b.log.Info("previous release built", "revision", base.Label, "binary", base.bin)
		versions = append(versions, base)
		rep.SteadyBaseline = base.Label
	}
	brokers, skipped := b.e2eBrokers()
	defer func() {
		for _, br := range brokers {
			br.close()
		}
	}()
	for _, s := range skipped {
		rep.Steady = append(rep.Steady, steadyRow{Kind: steadyLatency, Path: s.Path, Note: s.Note})
	}
	var cases []steadyCase
	for i := range brokers {
		for _, relays := range []int{1, 3} {
			cases = append(cases, steadyCase{kind: steadyLatency, path: brokers[i].name, mode: modeTable,
				relays: relays, rate: 1000, broker: &brokers[i]})
		}
	}
	for _, mode := range []string{modeTable, modeLog, modeLogOnly} {
		for _, rate := range []int{100, 1000} {
			cases = append(cases, steadyCase{kind: steadyCPU, path: mode, mode: mode, relays: 1, rate: rate})
		}
	}
	for _, c := range cases {
		if !selected(b.cfg.SteadyRows, strings.ReplaceAll(profileName(c), "-", " ")) {
			continue
		}
		// The versions of one row run back to back, so both see the same
		// machine.
		for _, v := range versions {
			b.settle(ctx)
			row, err := b.steadyRun(ctx, c, v)
			if err != nil {
				if ctx.Err() != nil {
					return err
				}
				b.log.Warn("steady row not measured", "kind", c.kind, "path", c.path, "version", v.Label, "error", err)
				row = steadyRow{Kind: c.kind, Path: c.path, Relays: c.relays, Rate: c.rate, Version: v.Label,
					Note: "not measured: " + err.Error()}
			}
			rep.Steady = append(rep.Steady, row)
		}
	}
	return nil
}

// buildBaseline builds the `outbox` binary of revision rev of the
// repository in the working directory, into a directory kept between runs
// (a build of the same commit is reused).
func buildBaseline(ctx context.Context, rev string) (steadyVersion, error) {
	if rev == "" || rev == "none" {
		return steadyVersion{}, errors.New("-baseline-rev is empty")
	}
	git := func(args ...string) (string, error) {
		out, err := exec.CommandContext(ctx, "git", args...).Output()
		if err != nil {
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				err = fmt.Errorf("%w: %s", err, strings.TrimSpace(string(ee.Stderr)))
			}
			return "", fmt.Errorf("git %s: %w", strings.Join(args, " "), err)
		}
		return strings.TrimSpace(string(out)), nil
	}
	full, err := git("rev-parse", "--verify", "--quiet", rev+"^{commit}")
	if err != nil {
		return steadyVersion{}, fmt.Errorf("find revision %s (the bench runs in the repository, with its history): %w", rev, err)
	}
	v := steadyVersion{Label: rev, bin: filepath.Join(os.TempDir(), "outbox-bench-baseline", full, "outbox")}
	if _, err := os.Stat(v.bin); err == nil {
		return v, nil
	}
	src, err := os.MkdirTemp("", "outbox-bench-src-")
	if err != nil {
		return v, fmt.Errorf("build %s: %w", rev, err)
	}
	defer os.RemoveAll(src)
	archive := exec.CommandContext(ctx, "git", "archive", "--format=tar", full)
	untar := exec.CommandContext(ctx, "tar", "-x", "-C", src)
	if untar.Stdin, err = archive.StdoutPipe(); err != nil {
		return v, fmt.Errorf("build %s: %w", rev, err)
	}
	if err := untar.Start(); err != nil {
		return v, fmt.Errorf("build %s: extract: %w", rev, err)
	}
	if err := archive.Run(); err != nil {
		_ = untar.Wait()
		return v, fmt.Errorf("build %s: git archive: %w", rev, err)
	}
	if err := untar.Wait(); err != nil {
		return v, fmt.Errorf("build %s: extract: %w", rev, err)
	}
	if err := os.MkdirAll(filepath.Dir(v.bin), 0o755); err != nil {
		return v, fmt.Errorf("build %s: %w", rev, err)
	}
	build := exec.CommandContext(ctx, "go", "build", "-o", v.bin+".tmp", "./cmd/outbox")
	build.Dir = src
	if out, err := build.CombinedOutput(); err != nil {
		return v, fmt.Errorf("build %s: go build: %w:\n%s", rev, err, out)
	}
	if err := os.Rename(v.bin+".tmp", v.bin); err != nil {
		return v, fmt.Errorf("build %s: %w", rev, err)
	}
	return v, nil
}

// versionCommand runs one command of version v's binary on cfg's schema.
func (b *bench) versionCommand(ctx context.Context, v steadyVersion, cfg store.Config, args ...string) error {
	cmd := exec.CommandContext(ctx, v.bin, args...)
	cmd.Env = append(os.Environ(), "DATABASE_URL="+b.cfg.DatabaseURL,
		"OUTBOX_STORE_SCHEMA="+cfg.Schema, "OUTBOX_STORE_NOTIFY_CHANNEL="+cfg.NotifyChannel)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("outbox (%s) %s: %w:\n%s", v.Label, strings.Join(args, " "), err, out)
	}
	return nil
}

// steadyApp names the producers' sessions, apart from the relays'.
const steadyApp = "outbox-bench-steady"

// steadyRun measures one case with one version.
func (b *bench) steadyRun(ctx context.Context, c steadyCase, v steadyVersion) (steadyRow, error) {
	row := steadyRow{Kind: c.kind, Path: c.path, Relays: c.relays, Rate: c.rate, Version: v.Label}
	b.seq++
	// Named per bench process: a relay or slot an earlier, interrupted run
	// left behind on the same server cannot meet this one.
	cfg := store.Config{Schema: fmt.Sprintf("bench_steady_%d_%d", os.Getpid(), b.seq)}
	cfg.NotifyChannel = cfg.Schema
	q := ident(cfg.Schema)
	if _, err := b.pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+q+" CASCADE"); err != nil {
		return row, fmt.Errorf("drop old schema: %w", err)
	}
	// Each version migrates its own schema: a binary may refuse a schema
	// of another version.
	if err := b.versionCommand(ctx, v, cfg, "migrate"); err != nil {
		return row, err
	}
	defer func() {
		if _, err := b.pool.Exec(context.WithoutCancel(ctx), "DROP SCHEMA "+q+" CASCADE"); err != nil {
			b.log.Warn("drop schema", "schema", cfg.Schema, "error", err)
		}
	}()
	env := []string{"OUTBOX_ROUTING_TOPIC=" + benchTopic}
	if c.broker != nil {
		env = append(env, c.broker.relayEnv...)
	}
	if c.mode != modeTable {
		env = append(env, "OUTBOX_RELAY_MODE=log")
		if err := b.versionCommand(ctx, v, cfg, "slot", "create"); err != nil {
			return row, err
		}
		defer func() { // after the relays stop: deferred before they start
			if err := b.versionCommand(context.WithoutCancel(ctx), v, cfg, "slot", "drop"); err != nil {
				b.log.Warn("drop the steady run's slot", "error", err)
			}
		}()
	}

	var rec *stamps
	if c.broker != nil {
		r, stop, err := startConsumer(ctx, *c.broker)
		if err != nil {
			return row, err
		}
		defer stop()
		rec = r
	}
	var relays []*relayProcess
	defer func() {
		for _, p := range relays {
			if err := p.stop(); err != nil {
				b.log.Warn("stop relay", "error", err)
			}
		}
	}()
	for i := range c.relays {
		argv, err := b.profileArgv(v, profileName(c), i)
		if err != nil {
			return row, err
		}
		p, err := b.startBinaryOf(ctx, argv, cfg, env...)
		if err != nil {
			return row, err
		}
		relays = append(relays, p)
	}
	pool, err := openPool(ctx, b.namedURL(steadyApp), 17, nil)
	if err != nil {
		return row, err
	}
	defer pool.Close()
	if err := warmPool(ctx, pool, 16); err != nil {
		return row, err
	}

	table := outboxTable(cfg)
	insert := `INSERT INTO ` + table + ` (event_id, aggregate_id, type, payload) VALUES ($1, $2, 'bench.event', '{"n":1}')`
	full, err := cfg.WithDefaults()
	if err != nil {
		return row, err
	}
	prefix := event.MessagePrefix(full.Schema, full.Table)
	var sent atomic.Int64
	// One event per transaction: a statement on its own commits when it
	// returns.
	produce := func(ctx context.Context, i int64) error {
		id, err := uuid.NewV7()
		if err != nil {
			return fmt.Errorf("new event id: %w", err)
		}
		uid, agg := id.String(), aggregateID(i, b.cfg.Aggregates)
		if c.mode == modeLogOnly {
			msg, err := event.EncodeLogMessage(event.LogMessage{ID: uid, AggregateID: agg, Type: "bench.event", Payload: []byte(`{"n":1}`)})
			if err != nil {
				return err
			}
			_, err = pool.Exec(ctx, `SELECT pg_logical_emit_message(true, $1, $2::text)`, prefix, string(msg))
			if err != nil {
				return fmt.Errorf("produce: %w", err)
			}
		} else if _, err := pool.Exec(ctx, insert, uid, agg); err != nil {
			return fmt.Errorf("produce: %w", err)
		}
		if rec != nil {
			rec.commit(uid, time.Now())
		}
		sent.Add(1)
		return nil
	}
	delivered := func() int64 {
		if rec != nil {
			_, p := rec.counts()
			return p
		}
		var n int64
		for _, p := range relays {
			n += p.lines.Load()
		}
		return n
	}
	failed := func() error {
		for _, p := range relays {
			if err := p.failed(); err != nil {
				return err
			}
		}
		return nil
	}

	// Warm up: a few events through the whole path (connections opened,
	// the slot streaming, the consumer reading), then measure from there.
	time.Sleep(300 * time.Millisecond)
	if err := openLoop(ctx, 160, 16, 100*time.Millisecond, produce); err != nil {
		return row, err
	}
	if got := waitCount(ctx, delivered, sent.Load(), 30*time.Second); got < sent.Load() {
		if err := failed(); err != nil {
			return row, err
		}
		return row, fmt.Errorf("warm up: %d of %d events delivered within 30s:\n%s", got, sent.Load(), relays[0].stderr)
	}
	time.Sleep(200 * time.Millisecond) // the warm-up's marks settle
	if rec != nil {
		rec.reset()
	}
	if c.kind == steadyCPU {
		idle := b.cfg.SteadyRun / 3
		i0 := b.steadyCPU(ctx, relays)
		select {
		case <-ctx.Done():
			return row, ctx.Err()
		case <-time.After(idle):
		}
		i1 := b.steadyCPU(ctx, relays)
		row.IdleRelay = time.Duration(float64(i1.relay-i0.relay) / idle.Seconds())
		row.IdleDB = time.Duration(float64(i1.db(i0)) / idle.Seconds())
	}
	before, warm := delivered(), sent.Load()
	cpu0 := b.steadyCPU(ctx, relays)
	var stmts *statements
	if v.Label == thisBuild {
		stmts = b.watchStatements(ctx, cfg.Schema)
	}

	start := time.Now()
	if err := openLoop(ctx, c.rate, 16, b.cfg.SteadyRun, produce); err != nil {
		return row, err
	}
	last := time.Now()
	n := sent.Load() - warm
	waitCount(ctx, func() int64 { return delivered() - before }, n, 10*time.Second)
	elapsed := time.Since(start)
	cpu1 := b.steadyCPU(ctx, relays)
	if stmts != nil {
		stmts.report(ctx, profileName(c), n, elapsed)
	}
	if err := failed(); err != nil {
		return row, err
	}

	row.Events = int(n)
	row.Achieved = float64(n) / last.Sub(start).Seconds()
	row.Missing = int(max(0, n-(delivered()-before)))
	row.RelayCPU, row.DBCPU = cpu1.relay-cpu0.relay, cpu1.db(cpu0)
	if rec != nil {
		lat, missing := rec.latencies()
		row.Missing = missing
		row.P50, row.P99 = percentile(lat, 50), percentile(lat, 99)
	}
	row.Note = steadyNote(c, elapsed, cpu1.sessions(cpu0))
	b.log.Info("steady", "kind", c.kind, "path", c.path, "relays", c.relays, "rate", c.rate, "version", v.Label,
		"events", n, "p50", row.P50, "p99", row.P99, "relay_us", perEventUS(row.RelayCPU, n), "db_us", perEventUS(row.DBCPU, n))
	return row, nil
}

func steadyNote(c steadyCase, window time.Duration, sessions int) string {
	var s string
	switch c.mode {
	case modeTable:
		s = "rows, one INSERT per transaction"
	case modeLog:
		s = "rows, one INSERT per transaction, read from the slot (relay.mode log)"
	case modeLogOnly:
		s = "log-only events, one pg_logical_emit_message per transaction (relay.mode log)"
	}
	if c.broker == nil {
		s += "; stdout broker into a pipe"
	} else {
		s += "; a consumer process stamps arrivals"
	}
	return fmt.Sprintf("%s; CPU over %s, %d server sessions", s, window.Round(10*time.Millisecond), sessions)
}

func perEventUS(d time.Duration, n int64) float64 {
	if n <= 0 {
		return 0
	}
	return float64(d) / float64(n) / 1e3
}

// cpuSnapshot is the CPU the relay processes and their server sessions
// had used at one moment.
type cpuSnapshot struct {
	relay   time.Duration
	session map[int]time.Duration // by server pid
}

// db sums what the sessions used since s0; a session that started since
// counts from zero.
func (s cpuSnapshot) db(s0 cpuSnapshot) time.Duration {
	var d time.Duration
	for pid, t := range s.session {
		d += t - s0.session[pid]
	}
	return d
}

func (s cpuSnapshot) sessions(s0 cpuSnapshot) int {
	n := len(s.session)
	for pid := range s0.session {
		if _, ok := s.session[pid]; !ok {
			n++ // ended during the window: its share is lost
		}
	}
	return n
}

// steadyCPU reads the on-CPU time of the relay processes (every thread)
// and of the server processes of their sessions: the relays' pools, the
// partition sharing session and the log relay's walsender, found by their
// application_name. schedstat counts nanoseconds; /proc/<pid>/stat's
// clock ticks are too coarse for a trickle.
func (b *bench) steadyCPU(ctx context.Context, relays []*relayProcess) cpuSnapshot {
	s := cpuSnapshot{session: map[int]time.Duration{}}
	for _, p := range relays {
		s.relay += schedOf([]int{p.cmd.Process.Pid}).run
	}
	rows, err := b.pool.Query(ctx, `SELECT pid FROM pg_stat_activity
WHERE datname = current_database() AND (application_name LIKE $1 || '%' OR application_name LIKE 'outbox share %')`, relayApplicationName)
	if err != nil {
		return s
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return s
	}
	for _, pid := range pids {
		s.session[int(pid)] = schedOf([]int{int(pid)}).run
	}
	return s
}
