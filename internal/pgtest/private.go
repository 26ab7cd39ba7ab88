package pgtest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// EnvPGBin names the variable holding the directory of the PostgreSQL
// binaries (initdb, pg_ctl) that `make test` uses.
const EnvPGBin = "OUTBOX_TEST_PG_BIN"

// Server is a PostgreSQL server of one test's own, on a loopback port, for
// what the shared server must not see: a shutdown, server-wide settings.
type Server struct {
	URL  string // of its postgres database, as superuser
	bin  string
	data string
	log  string
}

// Private starts a server of the test's own with wal_level=logical and
// the extra settings (name = value lines of postgresql.conf), stopped at
// cleanup. Without EnvPGBin the test is skipped, or fails under CI.
func Private(t testing.TB, settings map[string]string) *Server {
	t.Helper()
	bin := os.Getenv(EnvPGBin)
	if bin == "" {
		if os.Getenv("CI") != "" {
			t.Fatalf("%s is not set; run the tests with `make test`", EnvPGBin)
		}
		t.Skipf("%s is not set; `make test` sets it", EnvPGBin)
	}
	// Not under t.TempDir: its parent is private to this user, and
	// PostgreSQL refuses to run as root.
	dir, err := os.MkdirTemp("", "outbox-pg-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			t.Fatalf("running as root needs a postgres user to run PostgreSQL: %v", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		if err := os.Chown(dir, uid, gid); err != nil {
			t.Fatal(err)
		}
	}
	s := &Server{bin: bin, data: filepath.Join(dir, "data"), log: filepath.Join(dir, "pg.log")}
	if out, err := asPostgres(filepath.Join(bin, "initdb"), "-D", s.data, "-U", "postgres", "--auth=trust", "--no-sync").CombinedOutput(); err != nil {
		t.Fatalf("initdb: %v: %s", err, out)
	}
	port := freePort(t)
	conf := fmt.Sprintf("listen_addresses = '127.0.0.1'\nport = %d\nunix_socket_directories = '%s'\nwal_level = logical\nfsync = off\nmax_connections = 50\n", port, dir)
	for k, v := range settings {
		conf += k + " = " + v + "\n"
	}
	f, err := os.OpenFile(filepath.Join(s.data, "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err == nil {
		_, err = f.WriteString(conf)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}
	if err != nil {
		t.Fatalf("write postgresql.conf: %v", err)
	}
	if out, err := s.pgCtl(60*time.Second, "start", "-l", s.log); err != nil {
		t.Fatalf("start private PostgreSQL: %v: %s\n%s", err, out, tail(s.log))
	}
	t.Cleanup(func() { _, _ = s.pgCtl(60*time.Second, "stop", "-m", "immediate") })
	s.URL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port)
	return s
}

// Pool opens a pool on the server, closed at cleanup.
func (s *Server) Pool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), s.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// Stop shuts the server down in mode (smart, fast, immediate) and waits up
// to limit for it to finish.
func (s *Server) Stop(mode string, limit time.Duration) error {
	out, err := s.pgCtl(limit, "stop", "-m", mode)
	if err != nil {
		return fmt.Errorf("pg_ctl stop -m %s: %w: %s", mode, err, out)
	}
	return nil
}

// Start starts the server again after Stop.
func (s *Server) Start() error {
	if out, err := s.pgCtl(60*time.Second, "start", "-l", s.log); err != nil {
		return fmt.Errorf("pg_ctl start: %w: %s", err, out)
	}
	return nil
}

// Log is the end of the server's log, for a failure message.
func (s *Server) Log() string { return tail(s.log) }

func (s *Server) pgCtl(limit time.Duration, args ...string) ([]byte, error) {
	secs := strconv.Itoa(max(1, int(limit.Round(time.Second)/time.Second)))
	return asPostgres(filepath.Join(s.bin, "pg_ctl"), append([]string{"-D", s.data, "-w", "-t", secs}, args...)...).CombinedOutput()
}

// asPostgres runs a server binary, as the postgres user when run as root.
func asPostgres(name string, args ...string) *exec.Cmd {
	if os.Geteuid() == 0 {
		return exec.Command("runuser", append([]string{"-u", "postgres", "--", name}, args...)...)
	}
	return exec.Command(name, args...)
}

func freePort(t testing.TB) int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func tail(path string) string {
	b, _ := os.ReadFile(path)
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}
