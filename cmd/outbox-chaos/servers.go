package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Servers are a PostgreSQL and (optionally) a RabbitMQ of the run's own,
// started by scripts/services.sh on loopback, so faults hit nobody else.
type Servers struct {
	DatabaseURL string // superuser URL
	AMQPURL     string // empty without RabbitMQ

	pgBin, pgData                string
	rabbitNode, rabbitHome, epmd string
	cmd                          *exec.Cmd
	stdin                        io.WriteCloser
	exited                       chan struct{}
	logPath                      string
}

// StartServers runs scripts/services.sh from the module at root with a
// command that waits on its standard input: closing it (Stop, or this
// process dying) makes the script stop both servers.
func StartServers(ctx context.Context, root, dir string, rabbit bool) (*Servers, error) {
	envFile := filepath.Join(dir, "services.env")
	logPath := filepath.Join(dir, "services.log")
	logf, err := os.Create(logPath)
	if err != nil {
		return nil, fmt.Errorf("start servers: %w", err)
	}
	defer logf.Close()
	args := []string{filepath.Join(root, "scripts", "services.sh")}
	if !rabbit {
		args = append(args, "--no-rabbitmq")
	}
	args = append(args, "sh", "-c", "read _ || true")
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Dir = root
	cmd.Stdout, cmd.Stderr = logf, logf
	// A group of its own: a signal to ours must not stop the script before
	// its cleanup; it ends when its input closes, as when we die.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Env = append(withoutTestVars(os.Environ()), "OUTBOX_SERVICES_ENV="+envFile)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, fmt.Errorf("start servers: %w", err)
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start servers: %w", err)
	}
	s := &Servers{cmd: cmd, stdin: stdin, exited: make(chan struct{}), logPath: logPath}
	go func() { _ = cmd.Wait(); close(s.exited) }()

	// The script writes the file just before it runs the command. A first
	// run may install the server packages, hence the long wait.
	deadline := time.After(10 * time.Minute)
	for {
		vars, err := readEnvFile(envFile)
		if err == nil && vars["OUTBOX_TEST_DATABASE_URL"] != "" && (!rabbit || vars["OUTBOX_TEST_AMQP_URL"] != "") {
			s.DatabaseURL = vars["OUTBOX_TEST_DATABASE_URL"]
			s.AMQPURL = vars["OUTBOX_TEST_AMQP_URL"]
			s.pgBin, s.pgData = vars["OUTBOX_TEST_PG_BIN"], vars["OUTBOX_TEST_PG_DATA"]
			s.rabbitNode, s.rabbitHome = vars["OUTBOX_TEST_RABBITMQ_NODE"], vars["OUTBOX_TEST_RABBITMQ_HOME"]
			s.epmd = vars["OUTBOX_TEST_RABBITMQ_EPMD_PORT"]
			if s.pgBin == "" || s.pgData == "" || (rabbit && (s.rabbitNode == "" || s.epmd == "")) {
				s.Stop()
				return nil, errors.New("start servers: services.sh did not report how to control its servers")
			}
			return s, nil
		}
		select {
		case <-s.exited:
			return nil, fmt.Errorf("start servers: services.sh exited:\n%s", tail(logPath, 2000))
		case <-deadline:
			s.Stop()
			return nil, errors.New("start servers: timed out")
		case <-ctx.Done():
			s.Stop()
			return nil, fmt.Errorf("start servers: %w", ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// Stop ends the servers and waits for the script, at most a minute.
func (s *Servers) Stop() {
	_ = s.stdin.Close()
	select {
	case <-s.exited:
	case <-time.After(time.Minute):
		_ = s.cmd.Process.Kill()
		<-s.exited
	}
}

func withoutTestVars(environ []string) []string {
	var out []string
	for _, kv := range environ {
		if !strings.HasPrefix(kv, "OUTBOX_") && !strings.HasPrefix(kv, "DATABASE_URL=") {
			out = append(out, kv)
		}
	}
	return out
}

func readEnvFile(path string) (map[string]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	vars := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(strings.TrimPrefix(sc.Text(), "export "), "=")
		if ok {
			vars[k] = v
		}
	}
	return vars, sc.Err()
}

// asPostgres runs a server binary as the postgres user when we are root,
// as PostgreSQL refuses to run as root.
func asPostgres(name string, args ...string) *exec.Cmd {
	if os.Geteuid() == 0 {
		return exec.Command("runuser", append([]string{"-u", "postgres", "--", name}, args...)...)
	}
	return exec.Command(name, args...)
}

// StopPostgres shuts PostgreSQL down in mode "fast" or "immediate" (a
// crash: recovery runs at the next start).
func (s *Servers) StopPostgres(mode string) error {
	out, err := asPostgres(filepath.Join(s.pgBin, "pg_ctl"), "-D", s.pgData, "stop", "-m", mode, "-w", "-t", "60").CombinedOutput()
	if err != nil {
		return fmt.Errorf("stop postgres (%s): %w: %s", mode, err, out)
	}
	return nil
}

// StartPostgres starts it again with the options of its first start.
func (s *Servers) StartPostgres() error {
	opts, err := os.ReadFile(filepath.Join(s.pgData, "postmaster.opts"))
	if err != nil {
		return fmt.Errorf("start postgres: %w", err)
	}
	// The file holds the binary and its quoted arguments on one line,
	// among them the data directory, which pg_ctl adds again.
	_, args, _ := strings.Cut(strings.TrimSpace(string(opts)), " ")
	for {
		rest, ok := strings.CutPrefix(args, `"-D" "`+s.pgData+`"`)
		if !ok {
			break
		}
		args = strings.TrimSpace(rest)
	}
	logFile := filepath.Join(filepath.Dir(s.pgData), "pgsock", "pg.log")
	// The port is the one the relays' URLs name, so it cannot change. It
	// lies below the ephemeral range (scripts/services.sh), where only
	// another test's explicit pick can take it while the server is down;
	// such a listener is short-lived, so a failed bind is retried.
	for attempt := 1; attempt <= 10; attempt++ {
		var out []byte
		out, err = asPostgres(filepath.Join(s.pgBin, "pg_ctl"), "-D", s.pgData, "start", "-w", "-t", "120", "-l", logFile, "-o", args).CombinedOutput()
		if err == nil {
			return nil
		}
		err = fmt.Errorf("start postgres: %w: %s", err, out)
		if !strings.Contains(tail(logFile, 4000), "could not bind") {
			return err
		}
		time.Sleep(time.Second)
	}
	return err
}

func (s *Servers) rabbitctl(args ...string) error {
	_, err := s.rabbitctlOutput(args...)
	return err
}

func (s *Servers) rabbitctlOutput(args ...string) (string, error) {
	cmd := exec.Command("/usr/lib/rabbitmq/bin/rabbitmqctl", args...)
	cmd.Env = append(os.Environ(), "HOME="+s.rabbitHome, "RABBITMQ_NODENAME="+s.rabbitNode,
		"ERL_EPMD_ADDRESS=127.0.0.1", "ERL_EPMD_PORT="+s.epmd,
		"ERL_CRASH_DUMP="+filepath.Join(s.rabbitHome, "rabbitmqctl_crash.dump"))
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("rabbitmqctl %s: %w: %s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// rabbitPID is the operating system process of this run's RabbitMQ node
// (the Erlang VM), asked of the node itself so no other node is touched.
func (s *Servers) rabbitPID() (int, error) {
	out, err := s.rabbitctlOutput("eval", "os:getpid().")
	if err != nil {
		return 0, err
	}
	pid, err := strconv.Atoi(strings.Trim(strings.TrimSpace(out), `"`))
	if err != nil || pid <= 1 {
		return 0, fmt.Errorf("rabbitmqctl eval os:getpid(): unexpected answer %q", out)
	}
	return pid, nil
}

// FreezeRabbitMQ stops this run's RabbitMQ process (SIGSTOP) for d, then
// resumes it (SIGCONT): its sockets stay open and nothing answers.
func (s *Servers) FreezeRabbitMQ(ctx context.Context, d time.Duration) error {
	pid, err := s.rabbitPID()
	if err != nil {
		return err
	}
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		return fmt.Errorf("freeze rabbitmq %d: %w", pid, err)
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
	if err := syscall.Kill(pid, syscall.SIGCONT); err != nil {
		return fmt.Errorf("resume rabbitmq %d: %w", pid, err)
	}
	return nil
}

// StopRabbitMQ stops the broker application; the node stays up to start
// it again, and durable queues keep their persistent messages.
func (s *Servers) StopRabbitMQ() error { return s.rabbitctl("stop_app") }

// StartRabbitMQ starts the broker application again.
func (s *Servers) StartRabbitMQ() error {
	if err := s.rabbitctl("start_app"); err != nil {
		return err
	}
	return s.rabbitctl("await_startup")
}

// tail returns up to the last n bytes of a file, for error reports.
func tail(path string, n int64) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	if st, err := f.Stat(); err == nil && st.Size() > n {
		_, _ = f.Seek(st.Size()-n, io.SeekStart)
	}
	b, _ := io.ReadAll(f)
	return string(b)
}
