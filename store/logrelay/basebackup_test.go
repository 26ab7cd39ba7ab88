package logrelay_test

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// baseBackup copies primary into data, an empty data directory, over the
// replication protocol (BASE_BACKUP, with the WAL it needs), as
// pg_basebackup does in tar format: from PostgreSQL 15 on, one copy stream whose messages start
// with 'n' (a new archive: its name and tablespace), 'd' (its bytes), 'p'
// (progress) or 'm' (the manifest).
func baseBackup(ctx context.Context, t *testing.T, primary *pgtest.Server, data string) {
	t.Helper()
	cfg, err := pgconn.ParseConfig(primary.URL + "&replication=true")
	if err != nil {
		t.Fatal(err)
	}
	conn, err := pgconn.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := pglogrepl.StartBaseBackup(ctx, conn, pglogrepl.BaseBackupOptions{Label: "outbox test", Fast: true, WAL: true, NoWait: true}); err != nil {
		t.Fatalf("base backup: %v", err)
	}
	archives := map[string]*bytes.Buffer{}
	var cur *bytes.Buffer
	for done := false; !done; {
		msg, err := conn.ReceiveMessage(ctx)
		if err != nil {
			t.Fatalf("base backup: %v", err)
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
					t.Fatal("base backup: data before an archive")
				}
				cur.Write(m.Data[1:])
			}
		case *pgproto3.CopyDone:
			done = true
		case *pgproto3.ErrorResponse:
			t.Fatalf("base backup: %v", pgconn.ErrorResponseToPgError(m))
		default:
			t.Fatalf("base backup: unexpected %T", m)
		}
	}
	// The end position, then the command's end.
	for {
		msg, err := conn.ReceiveMessage(ctx)
		if err != nil {
			t.Fatalf("base backup: %v", err)
		}
		if m, ok := msg.(*pgproto3.ErrorResponse); ok {
			t.Fatalf("base backup: %v", pgconn.ErrorResponseToPgError(m))
		}
		if _, ok := msg.(*pgproto3.ReadyForQuery); ok {
			break
		}
	}
	base, ok := archives["base.tar"]
	if !ok {
		t.Fatalf("base backup sent no base.tar: %d archives", len(archives))
	}
	untar(t, base, data)
	if wal, ok := archives["pg_wal.tar"]; ok {
		untar(t, wal, filepath.Join(data, "pg_wal"))
	}
}

func untar(t *testing.T, r io.Reader, dest string) {
	t.Helper()
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return
		}
		if err != nil {
			t.Fatalf("base backup archive: %v", err)
		}
		name := filepath.Clean(h.Name)
		if filepath.IsAbs(name) || strings.HasPrefix(name, "..") {
			t.Fatalf("base backup archive names %q", h.Name)
		}
		path := filepath.Join(dest, name)
		switch h.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(path, 0o700); err != nil {
				t.Fatal(err)
			}
		case tar.TypeReg:
			f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := io.Copy(f, tr); err != nil {
				t.Fatal(err)
			}
			if err := f.Close(); err != nil {
				t.Fatal(err)
			}
		case tar.TypeSymlink:
			if err := os.Symlink(h.Linkname, path); err != nil {
				t.Fatal(err)
			}
		default:
			t.Fatalf("base backup archive: %q has type %c", h.Name, h.Typeflag)
		}
	}
}
