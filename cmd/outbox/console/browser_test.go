package console_test

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/chromedp"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/cmd/outbox/console"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store/admin"
	"github.com/outboxhq/outbox/store/table"
)

// EnvChromium names the browser the console's browser test drives;
// scripts/services.sh sets it, installing Debian's chromium when missing.
const EnvChromium = "OUTBOX_TEST_CHROMIUM"

// EnvScreenshots, when set, makes the browser test rewrite the console's
// screenshots in docs/img, which docs/operations.md shows.
const EnvScreenshots = "OUTBOX_TEST_SCREENSHOTS"

// chromium returns the browser to drive. Named by EnvChromium, it must
// work; otherwise one on PATH is used, and without one the test is
// skipped, or fails under CI, where skipping would hide untested code.
func chromium(t *testing.T) string {
	t.Helper()
	if p := os.Getenv(EnvChromium); p != "" {
		path, err := exec.LookPath(p)
		if err != nil {
			t.Fatalf("%s=%s: %v", EnvChromium, p, err)
		}
		return path
	}
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if path, err := exec.LookPath(name); err == nil {
			return path
		}
	}
	if os.Getenv("CI") != "" {
		t.Fatalf("no chromium and %s is not set; run the tests with `make test`, which installs it", EnvChromium)
	}
	t.Skipf("no chromium on PATH and %s is not set; `make test` installs it", EnvChromium)
	return ""
}

// broker stands for a broker with a routing rule missing: it refuses
// events of the refused type permanently until fixed, and records what
// it was sent.
type broker struct {
	refused string
	flaky   string // a type failing transiently, always
	fixed   atomic.Bool
	mu      sync.Mutex
	got     map[int64]bool
}

func (b *broker) Publish(_ context.Context, e *core.Event) error {
	if e.Type == b.refused && !b.fixed.Load() {
		return core.Permanent(fmt.Errorf("no route for type %q", e.Type))
	}
	if e.Type == b.flaky {
		return fmt.Errorf("publish %d: broker 10.0.3.%d:9092: request timed out after 30s", e.Seq, e.Seq%7)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.got[e.Seq] = true
	return nil
}

func (b *broker) Close() error { return nil }

func (b *broker) published(id int64) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.got[id]
}

// The operator's path through a real browser: the overview shows a held
// event, the held list leads to it, its page shows why, and after the
// routing is fixed a retry from that page gets it published.
func TestBrowserRetryHeldEvent(t *testing.T) {
	exe := chromium(t)
	// The relay connects as `outbox relay` does, so the overview lists it.
	const relayName = "relay-7f9c:4242"
	var running atomic.Pointer[core.Relay]
	f := newFixture(t, func(o *console.Options) {
		o.LocalRelay = func() (string, time.Time) {
			if r := running.Load(); r != nil {
				return relayName, r.LastProgress()
			}
			return relayName, time.Time{}
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	history(t, f)
	agg := uuid.NewString()
	ids := f.write(agg, "order.refunded", "order.closed")
	held, waiting := ids[0], ids[1]
	f.write(uuid.NewString(), "order.placed", "order.paid")
	f.write(uuid.NewString(), "invoice.sent")
	f.write(uuid.NewString(), "invoice.sent")
	parked := f.write(uuid.NewString(), "customer.merged")
	if _, err := f.ad.Park(f.ctx, admin.Selector{Seqs: parked}, "duplicate customer, merged by hand"); err != nil {
		t.Fatal(err)
	}

	pc := f.pool.Config().Copy()
	pc.ConnConfig.RuntimeParams["application_name"] = console.DefaultRelayApplication + " " + relayName
	relayPool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		t.Fatal(err)
	}
	defer relayPool.Close()
	relaySt, err := table.New(relayPool, f.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	b := &broker{refused: "order.refunded", flaky: "invoice.sent", got: map[int64]bool{}}
	relay, err := core.New(relaySt, b, core.Options{PollInterval: 100 * time.Millisecond,
		RetryBackoff: core.Backoff{Min: time.Minute, Max: time.Minute}})
	if err != nil {
		t.Fatal(err)
	}
	running.Store(relay)
	rctx, stopRelay := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(rctx) }()
	defer func() {
		stopRelay()
		if err := <-relayDone; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("relay: %v", err)
		}
	}()
	waitFor(t, ctx, "the event to be held", func() bool { return f.state(held) == admin.StateHeld })

	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(exe), chromedp.NoSandbox,
		chromedp.DisableGPU, chromedp.WindowSize(1280, 860), chromedp.Flag("headless", "new"))
	actx, cancelAlloc := chromedp.NewExecAllocator(ctx, opts...)
	defer cancelAlloc()
	bctx, cancelBrowser := chromedp.NewContext(actx)
	defer cancelBrowser()

	shots := os.Getenv(EnvScreenshots) != ""
	shot := func(name string) {
		t.Helper()
		if !shots {
			return
		}
		png, err := chromedp.Run(bctx, chromedp.FullScreenshot(100))
		if err != nil {
			t.Fatalf("screenshot %s: %v", name, err)
		}
		if err := os.WriteFile(filepath.Join("..", "..", "..", "docs", "img", name), png, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// Each step is bounded: a query waits for its element to appear. The
	// browser lives as long as bctx, so the bound is a context derived
	// from it once it has started.
	if err := chromedp.Do(bctx); err != nil {
		t.Fatalf("start %s: %v", exe, err)
	}
	step := func() (context.Context, context.CancelFunc) { return context.WithTimeout(bctx, 20*time.Second) }
	text := func(css string) string {
		t.Helper()
		sctx, cancel := step()
		defer cancel()
		s, err := chromedp.Run(sctx, chromedp.Text(chromedp.CSS(css)))
		if err != nil {
			t.Fatalf("text of %s: %v", css, err)
		}
		return strings.TrimSpace(s)
	}
	do := func(what string, steps ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		sctx, cancel := step()
		defer cancel()
		if err := chromedp.Do(sctx, steps...); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	// The browser signs in with basic auth, sent on every request.
	auth := base64.StdEncoding.EncodeToString([]byte(testUser + ":" + testPass))
	signIn := func(ctx context.Context, tg *chromedp.Target) (chromedp.Void, error) {
		_, err := cdp.Call(ctx, tg, network.SetExtraHTTPHeaders,
			network.SetExtraHTTPHeadersParams{Headers: network.Headers{"Authorization": "Basic " + auth}})
		return chromedp.Void{}, err
	}
	start := time.Now()
	do("open the overview", signIn, chromedp.Navigate(f.srv.URL+"/console/"))
	if n := text("#held-link .n"); n != "1" {
		t.Fatalf("the overview shows %q held events, want 1", n)
	}
	shot("console-overview.png")
	do("open the held events", chromedp.Click(chromedp.CSS("#held-link")),
		chromedp.WaitVisible(chromedp.CSS(fmt.Sprintf("#event-%d", held))))
	shot("console-held.png")
	do("open the held event", chromedp.Click(chromedp.CSS(fmt.Sprintf(`#event-%d a[href="/console/events/%d"]`, held, held))),
		chromedp.WaitVisible(chromedp.CSS("#state")))
	if state, errText := text("#state"), text("dd.err pre"); state != "held" || !strings.Contains(errText, "no route for type") {
		t.Fatalf("the event page says %q, error %q", state, errText)
	}
	shot("console-event.png")
	if b.published(held) || b.published(waiting) {
		t.Fatal("the held event, or the one waiting behind it, went out")
	}

	b.fixed.Store(true) // the operator adds the route
	do("retry", chromedp.Click(chromedp.CSS("#retry")), chromedp.WaitVisible(chromedp.CSS("#result")))
	if res := text("#result"); !strings.Contains(res, "1 event") {
		t.Fatalf("the result page says %q", res)
	}
	// Back on the event's page, it turns to dispatched once the relay has
	// published it.
	do("go back to the event", chromedp.Click(chromedp.CSS("#back")), chromedp.WaitVisible(chromedp.CSS("#state")))
	deadline := time.Now().Add(30 * time.Second)
	for state := text("#state"); state != "dispatched"; state = text("#state") {
		if time.Now().After(deadline) {
			t.Fatalf("the event page still says %q", state)
		}
		time.Sleep(100 * time.Millisecond)
		do("reload", chromedp.Reload())
	}
	if !b.published(held) {
		t.Error("the page says dispatched but the broker did not get the event")
	}
	waitFor(t, ctx, "the event behind it to go out", func() bool { return b.published(waiting) })
	if shots {
		// The failures page, with failures that stay.
		id := f.write(uuid.NewString(), "order.refunded")[0]
		b.fixed.Store(false)
		waitFor(t, ctx, "a new held event", func() bool { return f.state(id) == admin.StateHeld })
		do("open the failures", chromedp.Navigate(f.srv.URL+"/console/failures"))
		shot("console-failures.png")
	}
	t.Logf("browser walk-through took %s", time.Since(start).Round(time.Millisecond))
}

// history gives the chart an hour of published events and a few failing
// ones, as a relay would have left them.
func history(t *testing.T, f *fixture) {
	t.Helper()
	table := pgx.Identifier{f.cfg.Schema, "events_outbox"}.Sanitize()
	_, err := f.pool.Exec(f.ctx, `INSERT INTO `+table+` (event_id, aggregate_id, type, payload, created_at, dispatched_at, attempts, last_error, failed_at)
SELECT gen_random_uuid(), gen_random_uuid(), 'order.placed', '{"n":1}', d - interval '40 ms', d,
       CASE WHEN i % 97 = 0 THEN 1 ELSE 0 END,
       CASE WHEN i % 97 = 0 THEN 'broker: dial tcp 10.0.0.7:5672: connection refused' END,
       CASE WHEN i % 97 = 0 THEN d - interval '2 s' END
FROM generate_series(1, 3000) i,
     LATERAL (SELECT now() - make_interval(secs => 3540 * (1 - i / 3000.0) ^ 1.3) AS d) t`)
	if err != nil {
		t.Fatal(err)
	}
}

func waitFor(t *testing.T, ctx context.Context, what string, cond func() bool) {
	t.Helper()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("waiting for %s: %v", what, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}
