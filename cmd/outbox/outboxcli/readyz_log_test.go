package outboxcli

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store/logrelay"
)

// In relay.mode log, /readyz carries the log path's checks beside the
// table path's, and a relay that created its own slot (the shipped
// default) is ready once it reads it.
func TestReadyzInLogMode(t *testing.T) {
	pgtest.Logical(t)
	pool, cfg := pgtest.Schema(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	args := []string{"--database-url", pgtest.URL(t), "--schema", cfg.Schema}
	t.Cleanup(func() {
		if _, stderr, err := runCLI(context.Background(), append([]string{"slot", "drop"}, args...)...); err != nil {
			t.Errorf("slot drop: %v\n%s", err, stderr)
		}
	})
	rctx, stop := context.WithCancel(ctx)
	base, _, done := serving(t, rctx, "http", append([]string{"relay", "--mode", "log", "--broker", "stdout"}, args...)...)
	// Ready only counts once the relay reads the slot it created: before
	// that, its first session failed for the want of the slot.
	slot, err := logrelay.Slot{}.Resolve(ctx, pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	for active := false; !active; time.Sleep(50 * time.Millisecond) {
		err := pool.QueryRow(ctx, "SELECT active FROM pg_replication_slots WHERE slot_name = $1", slot.Name).Scan(&active)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			t.Fatalf("read slot %s: %v", slot.Name, err)
		}
		if ctx.Err() != nil {
			t.Fatalf("the relay never read its slot %s", slot.Name)
		}
	}
	// Bound: the readiness handler reads state the relay has already set
	// when it starts streaming; 10 s covers a loaded machine's scheduling.
	var code int
	var body string
	for range 100 {
		if code, _, body = get(t, base+"/readyz"); code == http.StatusOK {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if code != http.StatusOK || !strings.Contains(body, `"log":"ok"`) || !strings.Contains(body, `"log_progress":"ok"`) {
		t.Errorf("/readyz in log mode: %d %s, want 200 with the log checks", code, body)
	}
	stop()
	if err := <-done; err != nil {
		t.Fatalf("relay: %v", err)
	}
}
