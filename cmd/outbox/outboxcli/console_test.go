package outboxcli

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// serving runs the CLI with args plus --http-listen 127.0.0.1:0 until ctx
// is done, and returns the base URL of the address it bound, read from its
// log line "<what> listening": a port picked in advance could be taken by
// another test before the command binds it. stderr holds the log so far;
// done receives the command's error when it exits.
func serving(t *testing.T, ctx context.Context, what string, args ...string) (base string, stderr *syncBuffer, done <-chan error) {
	t.Helper()
	stderr = &syncBuffer{}
	exited := make(chan error, 1)
	go func() {
		root := NewRoot(io.Discard, stderr)
		root.SetArgs(append(args, "--http-listen", "127.0.0.1:0"))
		exited <- root.ExecuteContext(ctx)
	}()
	base = listenAddr(t, ctx, what, stderr, exited)
	waitHealthy(t, ctx, base, exited)
	return base, stderr, exited
}

// unusedAddr returns a loopback address nothing listens on, for a server a
// test starts late on purpose. It lies below the kernel's ephemeral range,
// where no outgoing connection or port-0 listener takes it meanwhile;
// servers a test starts at once bind port 0 instead (serving).
func unusedAddr(t *testing.T) string {
	t.Helper()
	lo := 32768
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if n, err := strconv.Atoi(f[0]); err == nil && n > 11000 {
				lo = n
			}
		}
	}
	for range 100 {
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(10000+rand.IntN(lo-10000)))
		if ln, err := net.Listen("tcp", addr); err == nil {
			ln.Close()
			return addr
		}
	}
	t.Fatal("no unused loopback port found")
	return ""
}

// listenAddr waits for the log line "<what> listening addr=..." in logs
// and returns the base URL of that address.
func listenAddr(t *testing.T, ctx context.Context, what string, logs fmt.Stringer, done <-chan error) string {
	t.Helper()
	line := regexp.MustCompile(what + ` listening" addr=(127\.0\.0\.1:\d+)`)
	for {
		if m := line.FindStringSubmatch(logs.String()); m != nil {
			return "http://" + m[1]
		}
		select {
		case err := <-done:
			t.Fatalf("exited before serving: %v\n%s", err, logs.String())
		case <-ctx.Done():
			t.Fatalf("not serving: %v\n%s", ctx.Err(), logs.String())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// syncBuffer is a bytes.Buffer a command writes while the test reads it.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// get sends a GET with the header set, not following redirects.
func get(t *testing.T, url string, header ...string) (int, http.Header, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	c := &http.Client{Timeout: 10 * time.Second, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := c.Do(req)
	if err != nil {
		return 0, nil, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, string(b)
}

func waitHealthy(t *testing.T, ctx context.Context, base string, done <-chan error) {
	t.Helper()
	for {
		if code, _, _ := get(t, base+"/healthz"); code == http.StatusOK {
			return
		}
		select {
		case err := <-done:
			t.Fatalf("exited before serving: %v", err)
		case <-ctx.Done():
			t.Fatal("not serving:", ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

const consoleToken = "console-token-0123456789"

// `outbox relay` serves the console beside /metrics when it is enabled,
// names itself among the relays with its last completed cycle, and never
// prints the token.
func TestRelayServesConsole(t *testing.T) {
	_, cfg := pgtest.Schema(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	t.Setenv("OUTBOX_CONSOLE_ENABLED", "true")
	t.Setenv("OUTBOX_CONSOLE_TOKEN", consoleToken)
	rctx, stop := context.WithCancel(ctx)
	base, stderrBuf, done := serving(t, rctx, "http", "relay", "--database-url", pgtest.URL(t), "--schema", cfg.Schema,
		"--broker", "gochannel", "--log-level", "debug")

	if code, _, _ := get(t, base+"/api/v1/overview"); code != http.StatusUnauthorized {
		t.Errorf("overview without the token: %d, want 401", code)
	}
	var o struct {
		Relays []struct {
			Client         string     `json:"client"`
			Local          bool       `json:"local"`
			LastProgressAt *time.Time `json:"last_progress_at"`
		} `json:"relays"`
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		code, _, body := get(t, base+"/api/v1/overview", "Authorization", "Bearer "+consoleToken)
		if code != http.StatusOK {
			t.Fatalf("overview: %d %s", code, body)
		}
		if err := json.Unmarshal([]byte(body), &o); err != nil {
			t.Fatal(err)
		}
		// Relays of other tests may share the database; this one is local.
		found := false
		for _, r := range o.Relays {
			found = found || r.Local && r.LastProgressAt != nil
		}
		if found {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the overview does not show this relay with its progress: %s", body)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if code, h, _ := get(t, base+"/"); code != http.StatusFound || h.Get("Location") != "/console/" {
		t.Errorf("GET /: %d to %q, want a redirect to the console", code, h.Get("Location"))
	}
	if code, _, _ := get(t, base+"/metrics"); code != http.StatusOK {
		t.Errorf("/metrics next to the console: %d", code)
	}
	stop()
	if err := <-done; err != nil {
		t.Fatalf("relay: %v\n%s", err, stderrBuf)
	}
	stderr := stderrBuf.String()
	if strings.Contains(stderr, consoleToken) {
		t.Errorf("the relay printed the console token:\n%s", stderr)
	}
	if !strings.Contains(stderr, "/console/ /api/v1/") {
		t.Errorf("the relay did not log the console's paths:\n%s", stderr)
	}
}

// `outbox console` serves the console with health endpoints and no
// relay or metrics.
func TestConsoleCommand(t *testing.T) {
	_, cfg := pgtest.Schema(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	t.Setenv("OUTBOX_CONSOLE_USERNAME", "ops")
	t.Setenv("OUTBOX_CONSOLE_PASSWORD", "console-password-0123")
	rctx, stop := context.WithCancel(ctx)
	base, _, done := serving(t, rctx, "console", "console", "--database-url", pgtest.URL(t), "--schema", cfg.Schema)
	req, _ := http.NewRequest(http.MethodGet, base+"/console/", nil)
	req.SetBasicAuth("ops", "console-password-0123")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	// Relays of other tests may share the database, so the list is not
	// looked at.
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), "oldest pending") {
		t.Errorf("console overview: %d\n%s", resp.StatusCode, b)
	}
	if code, _, body := get(t, base+"/readyz"); code != http.StatusOK || !strings.Contains(body, "database") {
		t.Errorf("/readyz: %d %s", code, body)
	}
	if code, _, _ := get(t, base+"/metrics"); code != http.StatusNotFound {
		t.Errorf("/metrics on the console alone: %d, want 404", code)
	}
	stop()
	if err := <-done; err != nil {
		t.Fatalf("console: %v", err)
	}
}

// The console's configuration is refused with the key named and the
// secret left out.
func TestConsoleConfigErrors(t *testing.T) {
	ctx := context.Background()
	url := "postgres://nobody@127.0.0.1:1/none"
	cases := []struct {
		env  []string
		args []string
		want string
	}{
		{[]string{"OUTBOX_CONSOLE_ENABLED=true", "OUTBOX_CONSOLE_TOKEN=" + consoleToken}, []string{"relay", "--broker", "gochannel"}, "console.enabled: needs http.listen"},
		{[]string{"OUTBOX_CONSOLE_ENABLED=true"}, []string{"relay", "--broker", "gochannel", "--http-listen", "127.0.0.1:0"}, "no credentials"},
		{nil, []string{"console", "--http-listen", "127.0.0.1:0"}, "no credentials"},
		{[]string{"OUTBOX_CONSOLE_TOKEN=sh0rt-s3cret"}, []string{"console", "--http-listen", "127.0.0.1:0"}, "console.token: is 12 bytes"},
		{[]string{"OUTBOX_CONSOLE_USERNAME=ops"}, []string{"console", "--http-listen", "127.0.0.1:0"}, "go together"},
		{[]string{"OUTBOX_CONSOLE_TOKEN=" + consoleToken}, []string{"console"}, "http.listen"},
		{[]string{"OUTBOX_CONSOLE_LAG_SLO=0s", "OUTBOX_CONSOLE_TOKEN=" + consoleToken}, []string{"console", "--http-listen", "127.0.0.1:0"}, "console.lag_slo"},
	}
	for _, c := range cases {
		t.Run(c.want, func(t *testing.T) {
			for _, kv := range c.env {
				k, v, _ := strings.Cut(kv, "=")
				t.Setenv(k, v)
			}
			_, _, err := runCLI(ctx, append(c.args, "--database-url", url)...)
			if err == nil || !strings.Contains(err.Error(), c.want) || ExitCode(err) != ExitUsage {
				t.Fatalf("err = %v (code %d), want a usage error with %q", err, ExitCode(err), c.want)
			}
			if strings.Contains(err.Error(), "sh0rt-s3cret") {
				t.Errorf("the error quotes the token: %v", err)
			}
		})
	}
}
