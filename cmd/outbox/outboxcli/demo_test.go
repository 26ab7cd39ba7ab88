package outboxcli

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// The demo is the README's promise in miniature; it fails when any of its
// figures (events of rolled-back orders, points credited twice) is off.
func TestDemoEndToEnd(t *testing.T) {
	url := pgtest.URL(t)
	var out, errOut bytes.Buffer
	root := NewRoot(&out, &errOut)
	root.SetArgs([]string{"demo", "--database-url", url, "--orders", "40", "--log-level", "warn"})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := root.ExecuteContext(ctx); err != nil {
		t.Fatalf("demo failed: %v\nstdout:\n%s\nstderr:\n%s", err, out.String(), errOut.String())
	}
	for _, want := range []string{
		"orders committed            30",
		"orders rolled back          10  (events for them: 0)",
		"events dispatched           30",
		"deliveries to the consumer  60",
		"events processed            30",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("demo output lacks %q:\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "WRONG") {
		t.Errorf("demo reports wrong points:\n%s", out.String())
	}
}
