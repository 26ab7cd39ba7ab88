package console_test

import (
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/cmd/outbox/console"
)

// Requests at the edges of the console's surface get clear answers.
func TestConsoleEdges(t *testing.T) {
	f := newFixture(t, nil)
	f.write("k-1", "order.placed")
	cases := []struct {
		name, method, path string
		code               int
		body               string // in the answer
	}{
		// The docs say 1-1000: 0 is not silently 50.
		{"limit 0", "GET", "/api/v1/events?state=pending&limit=0", http.StatusBadRequest, "limit: 0 is not between 1 and 1000"},
		{"limit over", "GET", "/api/v1/events?state=pending&limit=1001", http.StatusBadRequest, "limit: 1001 is not between 1 and 1000"},
		{"limit ok", "GET", "/api/v1/events?state=pending&limit=1", http.StatusOK, "\"limit\": 1\n"},
		{"limit unset", "GET", "/api/v1/events?state=pending", http.StatusOK, `"limit": 50`},
		{"limit 0 page", "GET", "/console/events?state=pending&limit=0", http.StatusBadRequest, "limit: 0 is not between 1 and 1000"},
		// The static files are served, their folder is not listed.
		{"static listing", "GET", "/console/static/", http.StatusNotFound, ""},
		// A known path with a method it does not take.
		{"PUT action", "PUT", "/api/v1/actions/retry", http.StatusMethodNotAllowed, "PUT"},
		{"DELETE event", "DELETE", "/api/v1/events/1", http.StatusMethodNotAllowed, "DELETE"},
		{"PUT page action", "PUT", "/console/actions/retry", http.StatusMethodNotAllowed, ""},
		{"unknown API path", "GET", "/api/v1/nothing", http.StatusNotFound, "no such API path"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			code, body := f.do(req{method: c.method, path: c.path, auth: "token"})
			if code != c.code || !strings.Contains(body, c.body) {
				t.Errorf("%s %s: %d %q, want %d with %q", c.method, c.path, code, trim(body), c.code, c.body)
			}
		})
	}
	code, body := f.do(req{method: "GET", path: "/console/events?state=pending", auth: "basic"})
	if code != http.StatusOK || strings.Contains(body, `placeholder="UUID"`) {
		t.Errorf("the aggregate filter suggests a UUID; keys are any string (%d)", code)
	}
}

func trim(s string) string {
	if len(s) > 300 {
		return s[:300] + "..."
	}
	return s
}

// The event page says how many of its aggregate's events it shows: the
// nearest five each side, not "every pending one".
func TestEventPageNeighbourNote(t *testing.T) {
	f := newFixture(t, nil)
	ids := f.write("k-n", "a", "b", "c", "d", "e", "f", "g", "h")
	code, body := f.do(req{method: "GET", path: fmt.Sprintf("/console/events/%d", ids[7]), auth: "basic"})
	if code != http.StatusOK {
		t.Fatalf("event page: %d", code)
	}
	if n := strings.Count(body, `<tr class="pending">`); n != 5 {
		t.Errorf("%d neighbours shown, want 5", n)
	}
	if strings.Contains(body, "every pending one") || !strings.Contains(body, "up to 5 on each side") || !strings.Contains(body, "10,000 rows") {
		t.Errorf("the note does not match what the page shows:\n%s", trim(body[strings.Index(body, "Its aggregate"):]))
	}
}

// A 4.5 MB payload (held: over store.max_event_bytes) is not rendered
// whole into the page or the JSON: they carry a preview and a link that
// downloads it, as an attachment.
func TestLargePayloadIsTruncatedWithDownload(t *testing.T) {
	f := newFixture(t, nil)
	cfg, err := f.cfg.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	var seq int64
	if err := f.pool.QueryRow(f.ctx, "INSERT INTO "+pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize()+
		" (event_id, aggregate_id, type, payload) VALUES (gen_random_uuid(), 'k-big', 'blob.put', jsonb_build_object('blob', repeat('x', 4500000)))"+
		" RETURNING seq").Scan(&seq); err != nil {
		t.Fatal(err)
	}
	const most = 200 << 10 // the preview, the page around it, the neighbours
	var d console.EventDetail
	f.getJSON(fmt.Sprintf("/api/v1/events/%d", seq), &d)
	if !d.PayloadTruncated || d.PayloadBytes < 4500000 || len(d.Payload) != 0 || len(d.PayloadPreview) != console.PayloadPreviewBytes {
		t.Errorf("JSON: truncated %v, %d bytes, payload %d, preview %d", d.PayloadTruncated, d.PayloadBytes, len(d.Payload), len(d.PayloadPreview))
	}
	code, body := f.do(req{method: "GET", path: fmt.Sprintf("/api/v1/events/%d", seq), auth: "token"})
	if code != http.StatusOK || len(body) > most {
		t.Errorf("JSON: %d, %d bytes", code, len(body))
	}
	code, body = f.do(req{method: "GET", path: fmt.Sprintf("/console/events/%d", seq), auth: "basic"})
	if code != http.StatusOK || len(body) > most || !strings.Contains(body, `href="`+d.PayloadURL+`" download`) {
		t.Errorf("page: %d, %d bytes, link to %s: %v", code, len(body), d.PayloadURL, strings.Contains(body, d.PayloadURL))
	}
	resp, err := http.Get(f.srv.URL + d.PayloadURL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("download without credentials: %d", resp.StatusCode)
	}
	code, body = f.do(req{method: "GET", path: d.PayloadURL, auth: "basic"})
	if code != http.StatusOK || len(body) != d.PayloadBytes || !strings.HasPrefix(body, `{"blob": "xxx`) {
		t.Errorf("download: %d, %d bytes of %d", code, len(body), d.PayloadBytes)
	}
}
