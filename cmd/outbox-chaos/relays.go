package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	neturl "net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/outboxhq/outbox/brokers/brokertest"
)

// BuildRelay builds cmd/outbox of the module at root into dir and checks
// that it knows broker.
func BuildRelay(ctx context.Context, root, dir, broker string) (string, error) {
	bin := filepath.Join(dir, "outbox")
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, "./cmd/outbox")
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build cmd/outbox: %w: %s", err, out)
	}
	out, err := exec.CommandContext(ctx, bin, "relay", "--help").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("run %s relay --help: %w: %s", bin, err, out)
	}
	if !strings.Contains(string(out), broker) {
		return "", fmt.Errorf("cmd/outbox does not register the %q broker:\n%s", broker, out)
	}
	return bin, nil
}

// relaySlot is one relay replica: a process restarted whenever it exits,
// as a service manager would, until the run ends.
type relaySlot struct {
	id      int
	bin     string
	env     []string
	logPath string
	log     *slog.Logger

	mu       sync.Mutex
	proc     *os.Process
	exits    int
	paused   bool
	stopping bool
	exited   chan struct{} // closed when the current process ends

	lines *lineStats
	// db, in log mode, is the relay's own way to PostgreSQL, which a
	// fault can cut without touching the other relays.
	db *brokertest.Proxy
}

// lineStats counts the relay's "relay cycle failed" lines per second, to
// show that it backs off instead of spinning while a server is down.
type lineStats struct {
	mu          sync.Mutex
	failures    int
	perSecond   map[int64]int
	publishWarn int
}

func (l *lineStats) add(line []byte) {
	var rec struct {
		Msg string `json:"msg"`
	}
	if json.Unmarshal(line, &rec) != nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	switch rec.Msg {
	case "relay cycle failed", "log relay stream failed":
		l.failures++
		l.perSecond[time.Now().Unix()]++
	case "publish failed":
		l.publishWarn++
	}
}

func (l *lineStats) failureCount() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.failures
}

func (l *lineStats) maxPerSecond() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	m := 0
	for _, n := range l.perSecond {
		m = max(m, n)
	}
	return m
}

func newRelaySlot(id int, bin, dir string, env []string, log *slog.Logger) *relaySlot {
	return &relaySlot{
		id: id, bin: bin, env: env, log: log.With("relay", id),
		logPath: filepath.Join(dir, fmt.Sprintf("relay-%d.log", id)),
		lines:   &lineStats{perSecond: map[int64]int{}},
	}
}

// supervise runs the relay until ctx is done, restarting it after each exit
// with a short, growing pause.
func (r *relaySlot) supervise(ctx context.Context) {
	pause := 500 * time.Millisecond
	for ctx.Err() == nil {
		started := time.Now()
		err := r.runOnce(ctx)
		if ctx.Err() != nil {
			return
		}
		r.mu.Lock()
		r.exits++
		r.mu.Unlock()
		if time.Since(started) > 10*time.Second {
			pause = 500 * time.Millisecond
		}
		r.log.Debug("relay exited; restarting", "error", err, "in", pause)
		select {
		case <-ctx.Done():
			return
		case <-time.After(pause):
		}
		pause = min(pause*2, 5*time.Second)
	}
}

func (r *relaySlot) runOnce(ctx context.Context) error {
	logf, err := os.OpenFile(r.logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.Command(r.bin, "relay")
	cmd.Env = r.env
	cmd.Stdout = logf
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return err
	}
	r.mu.Lock()
	if r.stopping {
		r.mu.Unlock()
		return nil
	}
	if err := cmd.Start(); err != nil {
		r.mu.Unlock()
		return err
	}
	r.proc, r.exited = cmd.Process, make(chan struct{})
	exited := r.exited
	r.mu.Unlock()

	// The log goes to a file and through the counter.
	copied := make(chan struct{})
	go func() {
		defer close(copied)
		sc := bufio.NewScanner(io.TeeReader(stderr, logf))
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			r.lines.add(sc.Bytes())
		}
	}()
	stopOnCancel := make(chan struct{})
	go func() {
		select {
		case <-ctx.Done():
			r.terminate(exited)
		case <-stopOnCancel:
		}
	}()
	<-copied
	err = cmd.Wait()
	close(stopOnCancel)
	r.mu.Lock()
	r.proc = nil
	r.paused = false
	close(exited)
	r.mu.Unlock()
	return err
}

// terminate stops the process gracefully, killing it if it lingers.
func (r *relaySlot) terminate(exited chan struct{}) {
	r.mu.Lock()
	r.stopping = true
	p := r.proc
	if p != nil && r.paused {
		_ = p.Signal(syscall.SIGCONT)
		r.paused = false
	}
	r.mu.Unlock()
	if p == nil {
		return
	}
	_ = p.Signal(syscall.SIGTERM)
	select {
	case <-exited:
	case <-time.After(40 * time.Second):
		_ = p.Kill()
	}
}

func (r *relaySlot) signal(sig syscall.Signal) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.proc == nil {
		return false
	}
	if r.proc.Signal(sig) != nil {
		return false
	}
	switch sig {
	case syscall.SIGSTOP:
		r.paused = true
	case syscall.SIGCONT:
		r.paused = false
	}
	return true
}

func (r *relaySlot) running() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.proc != nil
}

func (r *relaySlot) exitCount() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.exits
}

// clientPorts lists the ports PostgreSQL sees the relay's sessions come
// from (pg_stat_activity.client_port): its proxy's, or its own.
func (r *relaySlot) clientPorts() ([]int32, error) {
	if r.db != nil {
		return r.db.TargetPorts(), nil
	}
	return r.localPorts()
}

// localPorts lists the local TCP ports of the relay's open sockets.
func (r *relaySlot) localPorts() ([]int32, error) {
	r.mu.Lock()
	p := r.proc
	r.mu.Unlock()
	if p == nil {
		return nil, errors.New("relay is not running")
	}
	dir := fmt.Sprintf("/proc/%d", p.Pid)
	fds, err := os.ReadDir(dir + "/fd")
	if err != nil {
		return nil, err
	}
	inodes := map[string]bool{}
	for _, fd := range fds {
		if link, err := os.Readlink(dir + "/fd/" + fd.Name()); err == nil && strings.HasPrefix(link, "socket:[") {
			inodes[strings.TrimSuffix(strings.TrimPrefix(link, "socket:["), "]")] = true
		}
	}
	var ports []int32
	for _, table := range []string{"/net/tcp", "/net/tcp6"} {
		b, err := os.ReadFile(dir + table)
		if err != nil {
			continue
		}
		// Columns: sl local_address rem_address st ... uid timeout inode
		for _, line := range strings.Split(string(b), "\n")[1:] {
			cols := strings.Fields(line)
			if len(cols) < 10 || !inodes[cols[9]] {
				continue
			}
			_, port, ok := strings.Cut(cols[1], ":")
			if n, err := strconv.ParseInt(port, 16, 32); ok && err == nil {
				ports = append(ports, int32(n))
			}
		}
	}
	return ports, nil
}

// proxyDatabase sends the relay's database connections through a proxy
// of its own to the server of url.
func (r *relaySlot) proxyDatabase(url string) error {
	u, err := neturl.Parse(url)
	if err != nil {
		return fmt.Errorf("chaos: relay database url: %w", err)
	}
	if r.db, err = brokertest.Listen(u.Host); err != nil {
		return fmt.Errorf("chaos: relay database proxy: %w", err)
	}
	u.Host = r.db.Addr()
	env := make([]string, 0, len(r.env))
	for _, kv := range r.env {
		if !strings.HasPrefix(kv, "DATABASE_URL=") {
			env = append(env, kv)
		}
	}
	r.env = append(env, "DATABASE_URL="+u.String())
	return nil
}
