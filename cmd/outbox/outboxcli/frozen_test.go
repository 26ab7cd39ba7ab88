package outboxcli

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// A relay frozen with its claims open (SIGSTOP, as a long pause, a stalled
// VM or a partition would) holds only the rows it locked: another relay
// takes its partitions after share_timeout and publishes every event but
// those of the aggregates the frozen one holds, within share_timeout and a
// second. Two `outbox relay` processes, ordered, on the stdout broker.
func TestFrozenRelayHoldsOnlyItsLockedRows(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	pool, cfg := pgtest.Schema(t)
	cfg, err := cfg.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	table := pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize()
	// Two events each of 1000 aggregates: far more aggregates than the
	// frozen relay's claims can hold.
	if _, err := pool.Exec(ctx, "INSERT INTO "+table+" (aggregate_id, type, payload) SELECT 'key-' || (i % 1000), 't.x', '{}' FROM generate_series(0, 1999) i"); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), "outbox")
	if out, err := exec.Command("go", "build", "-o", bin, "../").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	const shareTimeout = 2 * time.Second
	dir := t.TempDir()
	env := []string{
		"PATH=" + os.Getenv("PATH"), "HOME=" + dir,
		"DATABASE_URL=" + pgtest.URL(t),
		"OUTBOX_BROKER=stdout",
		"OUTBOX_STORE_SCHEMA=" + cfg.Schema,
		"OUTBOX_STORE_SHARE_INTERVAL=100ms",
		"OUTBOX_STORE_SHARE_TIMEOUT=" + shareTimeout.String(),
		"OUTBOX_RELAY_BATCH_SIZE=50",
		"OUTBOX_LOG_LEVEL=warn",
	}
	start := func(name string, stdout io.Writer) *exec.Cmd {
		cmd := exec.Command(bin, "relay")
		cmd.Env = env
		cmd.Stdout = stdout
		logf, err := os.Create(filepath.Join(dir, name+".log"))
		if err != nil {
			t.Fatal(err)
		}
		cmd.Stderr = logf
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		t.Cleanup(func() {
			select {
			case <-done:
			case <-time.After(5 * time.Second):
				_ = cmd.Process.Kill()
				<-done
			}
			logf.Close()
			if t.Failed() {
				log, _ := os.ReadFile(logf.Name())
				t.Logf("relay %s's log:\n%s", name, log)
			}
		})
		return cmd
	}
	// a writes its events to a pipe nobody reads: once it is full, a's
	// publishes block and its claims stay open.
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	a := start("a", w)
	w.Close()
	host, _ := os.Hostname()
	appA := fmt.Sprintf("%s %s:%d", relayAppName, host, a.Process.Pid)
	openClaims := func() int {
		var open int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND state = 'idle in transaction'", appA).Scan(&open); err != nil {
			t.Fatal(err)
		}
		return open
	}
	waitUntil(t, 20*time.Second, "a to hold open claims", func() bool { return openClaims() > 0 })
	b := start("b", io.Discard)
	// Both own their half of the partitions, and a's claims are still open.
	waitUntil(t, 20*time.Second, "the relays to split the partitions", func() bool {
		var split int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM (SELECT l.pid FROM pg_locks l JOIN pg_stat_activity s USING (pid)
    WHERE s.application_name = $1 AND l.locktype = 'advisory' AND l.granted GROUP BY l.pid HAVING count(*) = 17) m`,
			"outbox share "+cfg.Schema+"."+cfg.Table).Scan(&split)
		return err == nil && split == 2
	})
	if openClaims() == 0 {
		t.Fatal("a's claims ended before it froze")
	}
	if err := a.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	frozen := time.Now()
	defer func() {
		// Let a go: it publishes to the pipe, now drained, and both stop.
		go func() { _, _ = io.Copy(io.Discard, r) }()
		_ = a.Process.Signal(syscall.SIGCONT)
		for _, c := range []*exec.Cmd{a, b} {
			_ = c.Process.Signal(syscall.SIGTERM)
		}
	}()

	// The aggregates of the rows a holds locked: their events must wait.
	// A statement a sent before it froze still runs to its end.
	waitUntil(t, 5*time.Second, "a's last statements", func() bool {
		var active int
		err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND state = 'active'", appA).Scan(&active)
		return err == nil && active == 0
	})
	var xids []string
	rows, err := pool.Query(ctx, "SELECT backend_xid::text FROM pg_stat_activity WHERE application_name = $1 AND backend_xid IS NOT NULL", appA)
	if err == nil {
		xids, err = pgx.CollectRows(rows, pgx.RowTo[string])
	}
	if err != nil {
		t.Fatal(err)
	}
	var held, heldAggs int
	if err := pool.QueryRow(ctx, "SELECT count(*), count(DISTINCT aggregate_id) FROM "+table+" WHERE dispatched_at IS NULL AND xmax::text = ANY($1)", xids).Scan(&held, &heldAggs); err != nil {
		t.Fatal(err)
	}
	if held == 0 {
		t.Fatal("the frozen relay holds no rows locked")
	}
	free := func() int {
		var n int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM `+table+` WHERE dispatched_at IS NULL AND aggregate_id NOT IN (
    SELECT aggregate_id FROM `+table+` WHERE dispatched_at IS NULL AND xmax::text = ANY($1))`, xids).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	left := free()
	var took time.Duration
	for {
		n := free()
		if n == 0 {
			took = time.Since(frozen)
			break
		}
		if time.Since(frozen) > shareTimeout+5*time.Second {
			t.Fatalf("%d events of aggregates the frozen relay does not hold still pending %v after it froze (%d then)", n, time.Since(frozen).Round(time.Millisecond), left)
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("a froze holding %d rows of %d aggregates; b published the other %d pending events within %v", held, heldAggs, left, took.Round(time.Millisecond))
	if took > shareTimeout+time.Second {
		t.Fatalf("the events the frozen relay does not hold took %v, over share_timeout (%v) and a second", took, shareTimeout)
	}
}

// waitUntil polls cond until it holds or within passes.
func waitUntil(t *testing.T, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
