package logrelay_test

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// pgServer is a PostgreSQL server of a test's own, on loopback, from a
// folder of server binaries. As root, it runs as the postgres user, as
// PostgreSQL refuses root.
type pgServer struct {
	t          *testing.T
	bin, base  string // binaries; the test's folder, holding every server's
	name, data string
	port       int
	settings   []string // -c settings on the command line
}

// pgOwner is the postgres user's ids when running as root; ok is false
// otherwise (files stay the test's own).
func pgOwner(t *testing.T) (uid, gid int, ok bool) {
	t.Helper()
	if os.Geteuid() != 0 {
		return 0, 0, false
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		t.Fatalf("running as root needs a postgres user to run PostgreSQL: %v", err)
	}
	uid, _ = strconv.Atoi(u.Uid)
	gid, _ = strconv.Atoi(u.Gid)
	return uid, gid, true
}

// ownDir makes dir (mode 0700) the server user's.
func ownDir(t *testing.T, dir string, mode os.FileMode) {
	t.Helper()
	if err := os.MkdirAll(dir, mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, mode); err != nil {
		t.Fatal(err)
	}
	own(t, dir)
}

func own(t *testing.T, path string) {
	t.Helper()
	if uid, gid, ok := pgOwner(t); ok {
		if err := os.Lchown(path, uid, gid); err != nil {
			t.Fatal(err)
		}
	}
}

// clusterBase is a folder the servers' user can enter, removed at the end.
func clusterBase(t *testing.T) string {
	t.Helper()
	base, err := os.MkdirTemp("", "outbox-cluster-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(base) })
	ownDir(t, base, 0o755)
	ownDir(t, filepath.Join(base, "sock"), 0o755)
	return base
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func newServer(t *testing.T, bin, base, name string, settings ...string) *pgServer {
	s := &pgServer{t: t, bin: bin, base: base, name: name, data: filepath.Join(base, name), port: freePort(t), settings: settings}
	t.Cleanup(func() { _ = s.ctl("stop", "-m", "immediate", "-w") })
	return s
}

// run runs a server binary as the server's user.
func (s *pgServer) run(prog string, args ...string) error {
	name := filepath.Join(s.bin, prog)
	cmd := exec.Command(name, args...)
	if _, _, ok := pgOwner(s.t); ok {
		cmd = exec.Command("runuser", append([]string{"-u", "postgres", "--", name}, args...)...)
	}
	cmd.Dir = s.base
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%s %s: %w: %s", prog, strings.Join(args, " "), err, out)
	}
	return nil
}

func (s *pgServer) ctl(args ...string) error {
	return s.run("pg_ctl", append([]string{"-D", s.data}, args...)...)
}

func (s *pgServer) initdb() {
	s.t.Helper()
	if err := s.run("initdb", "-D", s.data, "-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8"); err != nil {
		s.t.Fatal(err)
	}
}

func (s *pgServer) start() {
	s.t.Helper()
	opts := fmt.Sprintf("-c listen_addresses=127.0.0.1 -p %d -k %s", s.port, filepath.Join(s.base, "sock"))
	for _, kv := range s.settings {
		opts += " -c " + kv
	}
	if err := s.ctl("-l", s.data+".log", "-w", "-t", "120", "-o", opts, "start"); err != nil {
		log, _ := os.ReadFile(s.data + ".log")
		s.t.Fatalf("start %s: %v\n%s", s.name, err, log)
	}
}

// url is the server's database URL, with params added.
func (s *pgServer) url(db string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", s.port, db)
}

// writeFile writes a file of the server's data directory.
func (s *pgServer) writeFile(name, text string, appendTo bool) {
	s.t.Helper()
	flag := os.O_WRONLY | os.O_CREATE | os.O_TRUNC
	if appendTo {
		flag = os.O_WRONLY | os.O_CREATE | os.O_APPEND
	}
	path := filepath.Join(s.data, name)
	f, err := os.OpenFile(path, flag, 0o600)
	if err != nil {
		s.t.Fatal(err)
	}
	if _, err := f.WriteString(text); err != nil {
		s.t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		s.t.Fatal(err)
	}
	own(s.t, path)
}

// baseBackup copies primary into s's data directory over the replication
// protocol (BASE_BACKUP, with the WAL it needs), as pg_basebackup does in
// tar format: from PostgreSQL 15 on, one copy stream whose messages start
// with 'n' (a new archive: its name and tablespace), 'd' (its bytes), 'p'
// (progress) or 'm' (the manifest).
func (s *pgServer) baseBackup(ctx context.Context, primary *pgServer) {
	s.t.Helper()
	cfg, err := pgconn.ParseConfig(primary.url("postgres") + "&replication=true")
	if err != nil {
		s.t.Fatal(err)
	}
	conn, err := pgconn.ConnectConfig(ctx, cfg)
	if err != nil {
		s.t.Fatal(err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := pglogrepl.StartBaseBackup(ctx, conn, pglogrepl.BaseBackupOptions{Label: "outbox test", Fast: true, WAL: true, NoWait: true}); err != nil {
		s.t.Fatalf("base backup: %v", err)
	}
	archives := map[string]*bytes.Buffer{}
	var cur *bytes.Buffer
	for done := false; !done; {
		msg, err := conn.ReceiveMessage(ctx)
		if err != nil {
			s.t.Fatalf("base backup: %v", err)
		}
		switch m := msg.(type) {
		case *pgproto3.CopyOutResponse, *pgproto3.NoticeResponse:
		case *pgproto3.CopyData:
			switch m.Data[0] {
			case 'n':
				name, _, _ := strings.Cut(string(m.Data[1:]), "\x00")
				cur = &bytes.Buffer{}
				archives[name] = cur
			case 'd':
				if cur == nil {
					s.t.Fatal("base backup: data before an archive")
				}
				cur.Write(m.Data[1:])
			}
		case *pgproto3.CopyDone:
			done = true
		case *pgproto3.ErrorResponse:
			s.t.Fatalf("base backup: %v", pgconn.ErrorResponseToPgError(m))
		default:
			s.t.Fatalf("base backup: unexpected %T", m)
		}
	}
	// The end position, then the command's end.
	for {
		msg, err := conn.ReceiveMessage(ctx)
		if err != nil {
			s.t.Fatalf("base backup: %v", err)
		}
		if m, ok := msg.(*pgproto3.ErrorResponse); ok {
			s.t.Fatalf("base backup: %v", pgconn.ErrorResponseToPgError(m))
		}
		if _, ok := msg.(*pgproto3.ReadyForQuery); ok {
			break
		}
	}
	base, ok := archives["base.tar"]
	if !ok {
		s.t.Fatalf("base backup sent no base.tar: %d archives", len(archives))
	}
	ownDir(s.t, s.data, 0o700)
	s.untar(base, s.data)
	if wal, ok := archives["pg_wal.tar"]; ok {
		s.untar(wal, filepath.Join(s.data, "pg_wal"))
	}
}

func (s *pgServer) untar(r io.Reader, dest string) {
	s.t.Helper()
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return
		}
		if err != nil {
			s.t.Fatalf("base backup archive: %v", err)
		}
		name := filepath.Clean(h.Name)
		if filepath.IsAbs(name) || strings.HasPrefix(name, "..") {
			s.t.Fatalf("base backup archive names %q", h.Name)
		}
		path := filepath.Join(dest, name)
		switch h.Typeflag {
		case tar.TypeDir:
			ownDir(s.t, path, 0o700)
		case tar.TypeReg:
			f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
			if err != nil {
				s.t.Fatal(err)
			}
			if _, err := io.Copy(f, tr); err != nil {
				s.t.Fatal(err)
			}
			if err := f.Close(); err != nil {
				s.t.Fatal(err)
			}
			own(s.t, path)
		case tar.TypeSymlink:
			if err := os.Symlink(h.Linkname, path); err != nil {
				s.t.Fatal(err)
			}
			own(s.t, path)
		default:
			s.t.Fatalf("base backup archive: %q has type %c", h.Name, h.Typeflag)
		}
	}
}
