package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/store"
)

// relayProcess is the `outbox relay` binary running as a user runs it:
// its shipped defaults, with only the database, the table and the broker
// set through its environment. With the stdout broker, every line it
// writes is a published event, and the bench counts them.
type relayProcess struct {
	cmd    *exec.Cmd
	lines  atomic.Int64
	stderr *tailBuffer
	exited chan struct{}
	err    error // the process's exit, once exited is closed
}

// startBinary runs `outbox relay` on the schema of cfg; env adds
// OUTBOX_... settings (the broker's, --unordered as OUTBOX_RELAY_UNORDERED).
func (b *bench) startBinary(ctx context.Context, cfg store.Config, env ...string) (*relayProcess, error) {
	if b.cfg.Outbox == "" {
		return nil, errNotMeasured("no binary: -outbox names no `outbox` binary (make bench builds bin/outbox)")
	}
	return b.startBinaryOf(ctx, []string{b.cfg.Outbox}, cfg, env...)
}

// startBinaryOf is startBinary with the command line before `relay`
// given: this build's binary, another version's, or this program running
// the command line under a profile.
func (b *bench) startBinaryOf(ctx context.Context, argv []string, cfg store.Config, env ...string) (*relayProcess, error) {
	cmd := exec.CommandContext(ctx, argv[0], append(argv[1:], "relay")...)
	cmd.Env = append(os.Environ(), "DATABASE_URL="+b.cfg.DatabaseURL,
		"OUTBOX_STORE_SCHEMA="+cfg.Schema, "OUTBOX_STORE_NOTIFY_CHANNEL="+cfg.NotifyChannel)
	if len(env) == 0 || !hasPrefix(env, "OUTBOX_BROKER=") {
		cmd.Env = append(cmd.Env, "OUTBOX_BROKER=stdout")
	}
	cmd.Env = append(cmd.Env, env...)
	p := &relayProcess{cmd: cmd, stderr: &tailBuffer{max: 16 << 10}, exited: make(chan struct{})}
	cmd.Stderr = p.stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, fmt.Errorf("relay binary stdout: %w", err)
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start relay binary: %w", err)
	}
	read := make(chan struct{})
	go func() {
		defer close(read)
		buf := make([]byte, 256<<10)
		for {
			n, err := out.Read(buf)
			p.lines.Add(int64(bytes.Count(buf[:n], []byte{'\n'})))
			if err != nil {
				return
			}
		}
	}()
	go func() {
		<-read // Wait closes the pipe: read it to the end first
		p.err = cmd.Wait()
		close(p.exited)
	}()
	return p, nil
}

func hasPrefix(env []string, prefix string) bool {
	for _, kv := range env {
		if len(kv) >= len(prefix) && kv[:len(prefix)] == prefix {
			return true
		}
	}
	return false
}

// stop asks the relay to stop as a service manager does (SIGTERM) and
// waits for a clean exit.
func (p *relayProcess) stop() error {
	select {
	case <-p.exited:
	default:
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.exited:
		case <-time.After(40 * time.Second):
			_ = p.cmd.Process.Kill()
			<-p.exited
			return fmt.Errorf("relay binary did not stop within 40s after SIGTERM:\n%s", p.stderr)
		}
	}
	if p.err != nil {
		return fmt.Errorf("relay binary exited: %w:\n%s", p.err, p.stderr)
	}
	return nil
}

// failed returns the process's error if it has exited on its own.
func (p *relayProcess) failed() error {
	select {
	case <-p.exited:
		return fmt.Errorf("relay binary exited early (%v):\n%s", p.err, p.stderr)
	default:
		return nil
	}
}

// binaryDrain times the relay binary over a backlog of n: from starting
// the process until every event was written to its stdout and recorded as
// dispatched.
func (b *bench) binaryDrain(ctx context.Context, name string, cfg store.Config, n int, unordered bool, limit time.Duration) (rate, error) {
	if b.cfg.Outbox == "" {
		return rate{Name: name, Note: "not measured: -outbox names no binary (make bench builds bin/outbox)"}, nil
	}
	var env []string
	if unordered {
		env = append(env, "OUTBOX_RELAY_UNORDERED=true")
	}
	return b.binaryDrainEnv(ctx, name, cfg, n, limit, env...)
}

// binaryCommand runs one `outbox` command on the schema of cfg to its end.
func (b *bench) binaryCommand(ctx context.Context, cfg store.Config, args ...string) error {
	if b.cfg.Outbox == "" {
		return errNotMeasured("no binary: -outbox names no `outbox` binary (make bench builds bin/outbox)")
	}
	cmd := exec.CommandContext(ctx, b.cfg.Outbox, args...)
	cmd.Env = append(os.Environ(), "DATABASE_URL="+b.cfg.DatabaseURL,
		"OUTBOX_STORE_SCHEMA="+cfg.Schema, "OUTBOX_STORE_NOTIFY_CHANNEL="+cfg.NotifyChannel)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("outbox %v: %w:\n%s", args, err, out)
	}
	return nil
}

// binaryDrainEnv is binaryDrain with the relay's environment given.
func (b *bench) binaryDrainEnv(ctx context.Context, name string, cfg store.Config, n int, limit time.Duration, env ...string) (rate, error) {
	if b.cfg.Outbox == "" {
		return rate{Name: name, Note: "not measured: -outbox names no binary (make bench builds bin/outbox)"}, nil
	}
	start := time.Now()
	p, err := b.startBinary(ctx, cfg, env...)
	if err != nil {
		return rate{}, err
	}
	got := waitCount(ctx, p.lines.Load, int64(n), limit)
	if err := p.failed(); err != nil {
		return rate{}, err
	}
	// The last batches are recorded a moment after their lines are out.
	var pending int64
	if got >= int64(n) {
		deadline := time.Now().Add(10 * time.Second)
		for {
			if pending, err = b.pendingCount(ctx, cfg); err != nil {
				_ = p.stop()
				return rate{}, err
			}
			if pending == 0 || time.Now().After(deadline) || ctx.Err() != nil {
				break
			}
			time.Sleep(2 * time.Millisecond)
		}
	}
	elapsed := time.Since(start)
	dbCPU := b.sessionCPU(ctx, relayApplicationName)
	if err := p.stop(); err != nil {
		return rate{}, err
	}
	r := rate{Name: name, Events: min(got, int64(n)), Elapsed: elapsed, Note: "`outbox relay`, shipped defaults, stdout broker into a pipe",
		RelayCPU: p.cmd.ProcessState.UserTime() + p.cmd.ProcessState.SystemTime(), DBCPU: dbCPU}
	switch {
	case got < int64(n):
		r.Note += fmt.Sprintf("; stopped after %s with %d of %d written", limit, got, n)
	case pending != 0:
		r.Note += fmt.Sprintf("; %d events written but not recorded 10s after the last", pending)
	}
	b.log.Info("drained", "name", name, "events", r.Events, "took", elapsed.Round(time.Millisecond), "per_sec", int(r.PerSec()))
	return r, nil
}

// pendingCount counts events not yet dispatched.
func (b *bench) pendingCount(ctx context.Context, cfg store.Config) (int64, error) {
	var n int64
	if err := b.pool.QueryRow(ctx, `SELECT count(*) FROM `+outboxTable(cfg)+` WHERE dispatched_at IS NULL`).Scan(&n); err != nil {
		return 0, fmt.Errorf("count pending events: %w", err)
	}
	return n, nil
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	max int
	b   []byte
}

var _ io.Writer = (*tailBuffer)(nil)

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if over := len(t.b) - t.max; over > 0 {
		t.b = t.b[over:]
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.b)
}

// relayApplicationName starts the application_name of the relay binary's
// sessions.
const relayApplicationName = "outbox-relay"

// sessionCPU sums the CPU (user + system, from /proc) that the server
// processes of the sessions whose application_name starts with app have
// spent since they started: for a relay started for one drain, its
// sessions' share of the drain. Zero when the server's processes cannot be
// read (a server on another machine).
func (b *bench) sessionCPU(ctx context.Context, app string) time.Duration {
	rows, err := b.pool.Query(ctx, `SELECT pid FROM pg_stat_activity WHERE application_name LIKE $1 || '%'`, app)
	if err != nil {
		return 0
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return 0
	}
	var total time.Duration
	for _, pid := range pids {
		d, ok := procCPU(int(pid))
		if !ok {
			return 0
		}
		total += d
	}
	return total
}

// procCPU reads a process's user and system time from /proc/<pid>/stat.
func procCPU(pid int) (time.Duration, bool) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, false
	}
	// The command name, in parentheses, may hold spaces: count fields
	// after its closing parenthesis; utime and stime are fields 14 and 15.
	i := bytes.LastIndexByte(raw, ')')
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(string(raw[i+1:]))
	if len(f) < 13 {
		return 0, false
	}
	utime, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	const ticks = 100 // USER_HZ, which Linux fixes at 100 for /proc
	return time.Duration(utime+stime) * time.Second / ticks, true
}
