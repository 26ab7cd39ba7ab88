package outboxcli

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/outboxhq/outbox/store/pgtest"
)

// In relay.mode log, /readyz carries the log path's checks beside the
// table path's.
func TestReadyzInLogMode(t *testing.T) {
	pgtest.Logical(t)
	_, cfg := pgtest.Schema(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	args := []string{"--database-url", pgtest.URL(t), "--schema", cfg.Schema}
	t.Cleanup(func() {
		if _, stderr, err := runCLI(context.Background(), append([]string{"slot", "drop"}, args...)...); err != nil {
			t.Errorf("slot drop: %v\n%s", err, stderr)
		}
	})
	addr := freeAddr(t)
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		_, _, err := runCLI(rctx, append([]string{"relay", "--mode", "log", "--broker", "stdout", "--http-listen", addr}, args...)...)
		done <- err
	}()
	base := "http://" + addr
	waitHealthy(t, ctx, base, done)
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
