package pgtest

import (
	"context"
	"fmt"
	"io/fs"
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
// what the shared server must not see: a shutdown, server-wide settings,
// a standby.
type Server struct {
	URL  string // of its postgres database, as superuser
	Port int
	bin  string
	dir  string // holds data, the log and the socket
	data string
	log  string
}

// Options says how Start makes a server.
type Options struct {
	Bin      string            // folder of the server binaries; empty: EnvPGBin's
	Settings map[string]string // name = value lines of postgresql.conf
	// Fill, if set, fills the (empty) data folder instead of initdb, as a
	// base backup does. Settings are appended to the postgresql.conf it
	// leaves.
	Fill func(data string)
}

// Private starts a server of the test's own with wal_level=logical and
// the extra settings (name = value lines of postgresql.conf), stopped at
// cleanup. Without EnvPGBin the test is skipped, or fails under CI.
func Private(t testing.TB, settings map[string]string) *Server {
	t.Helper()
	return Start(t, Options{Settings: settings})
}

// Start starts a server as o says, with wal_level=logical and fsync off
// unless o.Settings says otherwise, stopped at cleanup.
func Start(t testing.TB, o Options) *Server {
	t.Helper()
	bin := o.Bin
	if bin == "" {
		if bin = os.Getenv(EnvPGBin); bin == "" {
			if os.Getenv("CI") != "" {
				t.Fatalf("%s is not set; run the tests with `make test`", EnvPGBin)
			}
			t.Skipf("%s is not set; `make test` sets it", EnvPGBin)
		}
	}
	// Not under t.TempDir: its parent is private to this user, and
	// PostgreSQL refuses to run as root.
	dir, err := os.MkdirTemp("", "outbox-pg-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	s := &Server{bin: bin, dir: dir, data: filepath.Join(dir, "data"), log: filepath.Join(dir, "pg.log"), Port: freePort(t)}
	if o.Fill != nil {
		if err := os.Mkdir(s.data, 0o700); err != nil {
			t.Fatal(err)
		}
		o.Fill(s.data)
	}
	if err := chownToPostgres(dir); err != nil {
		t.Fatal(err)
	}
	if o.Fill == nil {
		if out, err := s.run("initdb", "-D", s.data, "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8"); err != nil {
			t.Fatalf("initdb: %v: %s", err, out)
		}
	}
	// Later lines win: the settings over the defaults, and both over what
	// a filled postgresql.conf says.
	conf := fmt.Sprintf("\nlisten_addresses = '127.0.0.1'\nport = %d\nunix_socket_directories = '%s'\nwal_level = logical\nfsync = off\nmax_connections = 50\n", s.Port, dir)
	for k, v := range o.Settings {
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
	if err := s.Start(); err != nil {
		t.Fatalf("start private PostgreSQL: %v\n%s", err, tail(s.log))
	}
	t.Cleanup(func() { _, _ = s.pgCtl(60*time.Second, "stop", "-m", "immediate") })
	s.URL = s.Database("postgres")
	return s
}

// Database is the URL of the server's database name, as superuser.
func (s *Server) Database(name string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", s.Port, name)
}

// chownToPostgres gives the postgres user everything under dir when run
// as root; otherwise the files stay the test's own.
func chownToPostgres(dir string) error {
	if os.Geteuid() != 0 {
		return nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return fmt.Errorf("running as root needs a postgres user to run PostgreSQL: %w", err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return filepath.WalkDir(dir, func(path string, _ fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		return os.Lchown(path, uid, gid)
	})
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
	if out, err := s.pgCtl(120*time.Second, "start", "-l", s.log); err != nil {
		return fmt.Errorf("pg_ctl start: %w: %s", err, out)
	}
	return nil
}

// Log is the end of the server's log, for a failure message.
func (s *Server) Log() string { return tail(s.log) }

func (s *Server) pgCtl(limit time.Duration, args ...string) ([]byte, error) {
	secs := strconv.Itoa(max(1, int(limit.Round(time.Second)/time.Second)))
	return s.run("pg_ctl", append([]string{"-D", s.data, "-w", "-t", secs}, args...)...)
}

// Promote makes a standby a primary and waits up to limit for it.
func (s *Server) Promote(limit time.Duration) error {
	if out, err := s.pgCtl(limit, "promote"); err != nil {
		return fmt.Errorf("pg_ctl promote: %w: %s", err, out)
	}
	return nil
}

// run runs a server binary in the server's folder, as the postgres user
// when run as root.
func (s *Server) run(prog string, args ...string) ([]byte, error) {
	name := filepath.Join(s.bin, prog)
	cmd := exec.Command(name, args...)
	if os.Geteuid() == 0 {
		cmd = exec.Command("runuser", append([]string{"-u", "postgres", "--", name}, args...)...)
	}
	cmd.Dir = s.dir
	return cmd.CombinedOutput()
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
