package outboxcli

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/outboxhq/outbox/brokers/brokertest"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// readyz fetches /readyz from base: its status and checks.
func readyz(t *testing.T, base string) (int, map[string]string) {
	t.Helper()
	resp, err := http.Get(base + "/readyz")
	if err != nil {
		return 0, nil
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var body struct {
		Checks map[string]string `json:"checks"`
	}
	if err := json.Unmarshal(b, &body); err != nil {
		t.Fatalf("readyz body %q: %v", b, err)
	}
	return resp.StatusCode, body.Checks
}

// withHost returns raw with its host:port replaced.
func withHost(t *testing.T, raw, host string) string {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	u.Host = host
	return u.String()
}

// A relay started while nothing listens at the database's address, then at
// the broker's, waits: /healthz answers, /readyz names what it waits for,
// each attempt is logged; once a server appears there (a proxy started
// late) the relay gets ready without a restart.
func TestRelayWaitsForDatabaseAndBroker(t *testing.T) {
	_, cfg := pgtest.Schema(t)
	amqpURL := os.Getenv("OUTBOX_TEST_AMQP_URL")
	if amqpURL == "" {
		t.Skip("OUTBOX_TEST_AMQP_URL is not set; `make test` starts RabbitMQ")
	}
	pgURL, _ := url.Parse(pgtest.URL(t))
	brokerURL, _ := url.Parse(amqpURL)
	dbAddr, brokerAddr := unusedAddr(t), unusedAddr(t)
	t.Setenv("DATABASE_URL", withHost(t, pgURL.String(), dbAddr))
	t.Setenv("OUTBOX_BROKERS_AMQP_URL", withHost(t, amqpURL, brokerAddr))
	t.Setenv("OUTBOX_BROKERS_AMQP_CONNECT_TIMEOUT", "2s")

	// The bound covers the start, two rounds of backoff (at most 0.5s + 1s
	// + 2s + 4s before each server is seen) and a first cycle, with room
	// for a loaded machine.
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	rctx, stop := context.WithCancel(ctx)
	defer stop()
	var logs syncBuffer
	done := make(chan error, 1)
	go func() {
		root := NewRoot(io.Discard, &logs)
		root.SetArgs([]string{"relay", "--broker", "amqp", "--schema", cfg.Schema, "--http-listen", "127.0.0.1:0"})
		done <- root.ExecuteContext(rctx)
	}()
	base := listenAddr(t, ctx, "http", &logs, done)
	waitHealthy(t, ctx, base, done)

	// until polls /readyz until ok says yes.
	until := func(what string, ok func(code int, checks map[string]string) bool) map[string]string {
		t.Helper()
		for {
			code, checks := readyz(t, base)
			if ok(code, checks) {
				return checks
			}
			select {
			case err := <-done:
				t.Fatalf("relay exited while %s: %v\n%s", what, err, logs.String())
			case <-ctx.Done():
				t.Fatalf("%s: last /readyz %d %v\n%s", what, code, checks, logs.String())
			case <-time.After(50 * time.Millisecond):
			}
		}
	}
	checks := until("waiting for the database", func(code int, c map[string]string) bool {
		return code == http.StatusServiceUnavailable && strings.Contains(c["database"], "attempt 2")
	})
	if !strings.Contains(checks["database"], "connect to database") || checks["broker"] == "ok" {
		t.Errorf("readyz while the database is down: %v", checks)
	}
	if n := strings.Count(logs.String(), "waiting for the database"); n < 2 {
		t.Errorf("%d attempts logged, want one line per attempt:\n%s", n, logs.String())
	}

	dbProxy, err := brokertest.ListenOn(dbAddr, pgURL.Host)
	if err != nil {
		t.Fatal(err) // the port was taken in between: rare, and not the relay's fault
	}
	defer dbProxy.Cut()
	checks = until("waiting for the broker", func(code int, c map[string]string) bool {
		return c["database"] == "ok" && strings.Contains(c["broker"], "attempt")
	})
	if code, _ := readyz(t, base); code != http.StatusServiceUnavailable {
		t.Errorf("readyz %d while the broker is down, want 503 (%v)", code, checks)
	}

	brokerProxy, err := brokertest.ListenOn(brokerAddr, brokerURL.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer brokerProxy.Cut()
	until("ready", func(code int, _ map[string]string) bool { return code == http.StatusOK })
	for _, want := range []string{"waiting for the broker", "database reached", "broker reached", "relay starting"} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("log lacks %q:\n%s", want, logs.String())
		}
	}
	stop()
	if err := <-done; err != nil {
		t.Errorf("relay: %v", err)
	}
}

// relay.startup_timeout bounds the wait: past it the relay exits with
// code 3 naming the setting and what it could not reach.
func TestRelayStartupTimeout(t *testing.T) {
	t.Setenv("DATABASE_URL", "postgres://nobody@"+unusedAddr(t)+"/none?connect_timeout=1")
	t.Setenv("OUTBOX_RELAY_STARTUP_TIMEOUT", "2s")
	// 2s of waiting, plus a last attempt refused at once.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	start := time.Now()
	_, errOut, err := runCLI(ctx, "relay", "--broker", "stdout")
	if got := ExitCode(err); got != ExitUnavailable {
		t.Fatalf("exit code %d, want %d (err %v)\n%s", got, ExitUnavailable, err, errOut)
	}
	if el := time.Since(start); el < 2*time.Second || el > 20*time.Second {
		t.Errorf("gave up after %s, want about 2s", el)
	}
	if !strings.Contains(err.Error(), "relay.startup_timeout 2s") || !strings.Contains(err.Error(), "database") {
		t.Errorf("error %q names neither the setting nor the database", err)
	}
	if n := strings.Count(errOut, "waiting for the database"); n < 2 {
		t.Errorf("%d attempts logged:\n%s", n, errOut)
	}
}
