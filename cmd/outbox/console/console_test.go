package console_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/cmd/outbox/console"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/admin"
	"github.com/outboxhq/outbox/store/table"
)

const (
	testToken = "tok-0123456789abcdef"
	testUser  = "ops"
	testPass  = "pass-0123456789abcdef"
)

type fixture struct {
	t    *testing.T
	ctx  context.Context
	pool *pgxpool.Pool
	cfg  store.Config
	st   *table.Source
	ad   *admin.Admin
	srv  *httptest.Server
}

func newFixture(t *testing.T, mod func(*console.Options)) *fixture {
	t.Helper()
	pool, cfg := pgtest.Schema(t)
	st, err := table.New(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ad, err := admin.New(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	opts := console.Options{Admin: ad, Token: testToken, Username: testUser, Password: testPass}
	if mod != nil {
		mod(&opts)
	}
	c, err := console.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(c)
	t.Cleanup(srv.Close)
	return &fixture{t: t, ctx: context.Background(), pool: pool, cfg: cfg, st: st, ad: ad, srv: srv}
}

// write commits one event per type for aggregate agg and returns their ids.
func (f *fixture) write(agg string, types ...string) []int64 {
	f.t.Helper()
	w, err := outbox.NewWriter(outbox.WriterOptions{Store: f.cfg})
	if err != nil {
		f.t.Fatal(err)
	}
	var ids []int64
	err = pgx.BeginFunc(f.ctx, f.pool, func(tx pgx.Tx) error {
		for _, typ := range types {
			eventID := uuid.Must(uuid.NewV7()).String()
			if err := w.Write(f.ctx, tx, outbox.Message{ID: eventID, AggregateID: agg, Type: typ, Payload: map[string]string{"type": typ}}); err != nil {
				return err
			}
			var id int64
			if err := tx.QueryRow(f.ctx, "SELECT seq FROM "+pgx.Identifier{f.cfg.Schema, "events_outbox"}.Sanitize()+" WHERE event_id = $1", eventID).Scan(&id); err != nil {
				return err
			}
			ids = append(ids, id)
		}
		return nil
	})
	if err != nil {
		f.t.Fatal(err)
	}
	return ids
}

// hold fails the events ids permanently through a claim, as the relay
// does when the broker rejects them.
func (f *fixture) hold(reason string, ids ...int64) {
	f.t.Helper()
	c, err := f.st.Claim(f.ctx, core.ClaimOptions{Limit: 1000})
	if err != nil {
		f.t.Fatal(err)
	}
	var failed []core.Failure
	for _, e := range c.Events() {
		for _, id := range ids {
			if e.Seq == id {
				failed = append(failed, core.Failure{Seq: id, Reason: fmt.Sprintf(reason, id)})
			}
		}
	}
	if len(failed) != len(ids) {
		f.t.Fatalf("claimed %d of %d events to hold", len(failed), len(ids))
	}
	if err := c.Complete(f.ctx, nil, failed); err != nil {
		f.t.Fatal(err)
	}
}

func (f *fixture) state(id int64) admin.EventState {
	f.t.Helper()
	d, err := f.ad.Event(f.ctx, id, "")
	if err != nil {
		f.t.Fatal(err)
	}
	return d.State()
}

type req struct {
	method, path, body, contentType string
	auth                            string // "token", "basic", "wrong" or ""
	header                          http.Header
}

func (f *fixture) do(r req) (int, string) {
	f.t.Helper()
	hr, err := http.NewRequest(r.method, f.srv.URL+r.path, strings.NewReader(r.body))
	if err != nil {
		f.t.Fatal(err)
	}
	if r.contentType != "" {
		hr.Header.Set("Content-Type", r.contentType)
	}
	switch r.auth {
	case "token":
		hr.Header.Set("Authorization", "Bearer "+testToken)
	case "basic":
		hr.SetBasicAuth(testUser, testPass)
	case "wrong":
		hr.SetBasicAuth(testUser, "not-the-password")
	}
	for k, v := range r.header {
		hr.Header[k] = v
	}
	resp, err := http.DefaultClient.Do(hr)
	if err != nil {
		f.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func (f *fixture) getJSON(path string, v any) {
	f.t.Helper()
	code, body := f.do(req{method: "GET", path: path, auth: "token"})
	if code != http.StatusOK {
		f.t.Fatalf("GET %s: %d %s", path, code, body)
	}
	if err := json.Unmarshal([]byte(body), v); err != nil {
		f.t.Fatalf("GET %s: %v\n%s", path, err, body)
	}
}

func TestAPIReads(t *testing.T) {
	f := newFixture(t, nil)
	agg := uuid.NewString()
	ids := f.write(agg, "order.placed", "order.paid", "order.shipped")
	other := f.write(uuid.NewString(), "invoice.sent")
	f.hold("permanent: event %d: no route for type", ids[0], other[0])

	var o console.Overview
	f.getJSON("/api/v1/overview", &o)
	if o.Pending != 4 || o.Held != 2 || o.Stuck != 2 || len(o.Activity) != 60 || o.Access.User != "token" || !o.Access.CanAct {
		t.Errorf("overview = %+v", o)
	}
	var failing int64
	for _, m := range o.Activity {
		failing += m.Failed
	}
	if failing != 2 {
		t.Errorf("activity counts %d failing, want 2", failing)
	}

	var ev console.Events
	f.getJSON("/api/v1/events?state=held", &ev)
	if len(ev.Events) != 2 || ev.Events[0].Seq != ids[0] || ev.Events[0].HeldBack != 2 || ev.Events[0].State != "held" {
		t.Fatalf("held events = %+v", ev.Events)
	}
	ev = console.Events{}
	f.getJSON("/api/v1/events?state=pending&aggregate="+agg+"&limit=2", &ev)
	if len(ev.Events) != 2 || ev.NextAfter != ids[1] || ev.Events[1].WaitsFor != ids[0] {
		t.Errorf("first page = %+v, next after %d", ev.Events, ev.NextAfter)
	}
	next := ev.NextAfter
	ev = console.Events{}
	f.getJSON(fmt.Sprintf("/api/v1/events?state=pending&aggregate=%s&after=%d", agg, next), &ev)
	if len(ev.Events) != 1 || ev.Events[0].Seq != ids[2] || ev.NextAfter != 0 {
		t.Errorf("second page = %+v", ev.Events)
	}

	var d console.EventDetail
	f.getJSON(fmt.Sprintf("/api/v1/events/%d", ids[1]), &d)
	var payload map[string]string
	_ = json.Unmarshal(d.Payload, &payload)
	if d.Seq != ids[1] || payload["type"] != "order.paid" || len(d.Before) != 1 || len(d.After) != 1 || d.WaitsFor != ids[0] {
		t.Errorf("event = %+v", d)
	}
	var byID console.EventDetail
	f.getJSON("/api/v1/events/"+d.ID, &byID)
	if byID.Seq != d.Seq {
		t.Errorf("by event id: %d, want %d", byID.Seq, d.Seq)
	}

	var fl console.Failures
	f.getJSON("/api/v1/failures", &fl)
	if len(fl.Groups) != 1 || fl.Groups[0].Events != 2 || fl.Groups[0].Held != 2 || fl.Groups[0].Fingerprint != "permanent: event <n>: no route for type" {
		t.Errorf("failures = %+v", fl)
	}

	var p console.Preview
	f.getJSON("/api/v1/actions/retry?"+url.Values{"fingerprint": {fl.Groups[0].Fingerprint}}.Encode(), &p)
	if p.Count != 2 || p.More || !strings.Contains(p.Description, "error like") {
		t.Errorf("preview = %+v", p)
	}

	for _, c := range []struct{ path, want string }{
		{"/api/v1/events?state=lost", "state"},
		{"/api/v1/events?state=held&limit=5000", "limit"},
		{"/api/v1/events?state=held&created_after=yesterday", "created_after"},
		{"/api/v1/events?state=held&aggregate=x%01", "aggregate"},
		{"/api/v1/events/abc", "event"},
		{"/api/v1/actions/retry", "selector is empty"},
		{"/api/v1/actions/retry?seq=x", "seq"},
	} {
		code, body := f.do(req{method: "GET", path: c.path, auth: "token"})
		if code != http.StatusBadRequest || !strings.Contains(body, c.want) {
			t.Errorf("GET %s: %d %s; want 400 naming %s", c.path, code, body, c.want)
		}
	}
	for _, path := range []string{"/api/v1/events/999999999", "/api/v1/actions/delete?seq=1", "/api/v1/nothing"} {
		if code, body := f.do(req{method: "GET", path: path, auth: "token"}); code != http.StatusNotFound {
			t.Errorf("GET %s: %d %s, want 404", path, code, body)
		}
	}
}

func TestAPIActions(t *testing.T) {
	f := newFixture(t, nil)
	ids := f.write(uuid.NewString(), "order.placed", "order.paid")
	f.hold("permanent: no route (event %d)", ids[0])

	post := func(action, body string) (int, map[string]any) {
		t.Helper()
		code, b := f.do(req{method: "POST", path: "/api/v1/actions/" + action, body: body, contentType: "application/json", auth: "token"})
		var m map[string]any
		if err := json.Unmarshal([]byte(b), &m); err != nil {
			t.Fatalf("%s: %v\n%s", action, err, b)
		}
		return code, m
	}
	if code, m := post("retry", fmt.Sprintf(`{"seqs":[%d]}`, ids[0])); code != 200 || m["count"] != 1.0 {
		t.Errorf("retry: %d %v", code, m)
	}
	if s := f.state(ids[0]); s != admin.StatePending {
		t.Errorf("after retry the event is %s, want pending", s)
	}
	if code, m := post("park", fmt.Sprintf(`{"seqs":[%d]}`, ids[1])); code != 400 || !strings.Contains(fmt.Sprint(m["error"]), "reason") {
		t.Errorf("park without reason: %d %v", code, m)
	}
	if code, m := post("park", fmt.Sprintf(`{"seqs":[%d],"reason":"bad data"}`, ids[1])); code != 200 || m["count"] != 1.0 {
		t.Errorf("park: %d %v", code, m)
	}
	if code, m := post("unpark", fmt.Sprintf(`{"from_seq":%d,"to_seq":%d}`, ids[0], ids[1])); code != 200 || m["count"] != 1.0 {
		t.Errorf("unpark: %d %v", code, m)
	}
	if code, m := post("retry", `{"ids":[1]}`); code != 400 || !strings.Contains(fmt.Sprint(m["error"]), "ids") {
		t.Errorf("unknown field: %d %v", code, m)
	}
	if code, m := post("retry", `{}`); code != 400 || !strings.Contains(fmt.Sprint(m["error"]), "selector is empty") {
		t.Errorf("empty selector: %d %v", code, m)
	}
	if _, err := f.pool.Exec(f.ctx, "UPDATE "+pgx.Identifier{f.cfg.Schema, "events_outbox"}.Sanitize()+" SET dispatched_at = now()"); err != nil {
		t.Fatal(err)
	}
	if code, m := post("replay", fmt.Sprintf(`{"seqs":[%d,%d]}`, ids[0], ids[1])); code != 200 || m["count"] != 2.0 {
		t.Errorf("replay: %d %v", code, m)
	}
}

// writeRoutes are every request that acts, with a body that would act on
// event id when let through.
func writeRoutes(id int64) []req {
	var out []req
	for _, a := range admin.Actions {
		out = append(out,
			req{method: "POST", path: "/api/v1/actions/" + string(a), contentType: "application/json",
				body: fmt.Sprintf(`{"seqs":[%d],"reason":"r"}`, id)},
			req{method: "POST", path: "/console/actions/" + string(a), contentType: "application/x-www-form-urlencoded",
				body: fmt.Sprintf("seq=%d&reason=r&confirmed=1", id)})
	}
	return out
}

// Every write endpoint refuses a request without credentials, with wrong
// ones, from another site, a form without its CSRF token, the API without
// JSON, and anything in read-only mode; a GET on an action path only
// counts. The held event stays held throughout.
func TestWriteEndpointsRefuse(t *testing.T) {
	f := newFixture(t, nil)
	ro := newFixture(t, func(o *console.Options) { o.ReadOnly = true })
	for _, fx := range []*fixture{f, ro} {
		id := fx.write(uuid.NewString(), "order.placed")[0]
		fx.hold("permanent: no route %d", id)
		for _, r := range writeRoutes(id) {
			type attempt struct {
				name string
				r    req
				want int
			}
			var attempts []attempt
			if fx == ro {
				for _, auth := range []string{"token", "basic"} {
					a := r
					a.auth = auth
					if strings.HasPrefix(r.path, "/console/") {
						a.body += "&csrf=" + csrfFor(t, fx, auth)
					}
					attempts = append(attempts, attempt{"read-only, " + auth, a, http.StatusForbidden})
				}
			} else {
				none, wrong := r, r
				wrong.auth = "wrong"
				attempts = append(attempts, attempt{"no credentials", none, http.StatusUnauthorized},
					attempt{"wrong credentials", wrong, http.StatusUnauthorized})
				for _, h := range []http.Header{
					{"Sec-Fetch-Site": {"cross-site"}},
					{"Origin": {"https://evil.example"}},
				} {
					x := r
					x.auth, x.header = "basic", h
					if strings.HasPrefix(r.path, "/console/") {
						x.body += "&csrf=" + csrfFor(t, fx, "basic")
					}
					attempts = append(attempts, attempt{fmt.Sprint("cross-site ", h), x, http.StatusForbidden})
				}
				if strings.HasPrefix(r.path, "/console/") {
					noToken, badToken := r, r
					noToken.auth, badToken.auth = "basic", "basic"
					badToken.body += "&csrf=AAAA" + strings.Repeat("x", 50)
					attempts = append(attempts, attempt{"form without CSRF token", noToken, http.StatusForbidden},
						attempt{"form with a forged CSRF token", badToken, http.StatusForbidden})
					// A token rendered for another user is not valid.
					other := r
					other.auth = "basic"
					other.body += "&csrf=" + csrfFor(t, fx, "token")
					attempts = append(attempts, attempt{"CSRF token of another caller", other, http.StatusForbidden})
				} else {
					form := r
					form.auth, form.contentType = "token", "application/x-www-form-urlencoded"
					attempts = append(attempts, attempt{"API without JSON", form, http.StatusUnsupportedMediaType})
				}
				get := r
				get.method, get.auth = "GET", "token"
				get.path += fmt.Sprintf("?seq=%d&reason=r", id)
				attempts = append(attempts, attempt{"GET", get, http.StatusOK})
			}
			for _, a := range attempts {
				code, body := fx.do(a.r)
				if code != a.want {
					t.Errorf("%s %s (%s): %d %s, want %d", a.r.method, a.r.path, a.name, code, short(body), a.want)
				}
				if s := fx.state(id); s != admin.StateHeld {
					t.Fatalf("%s %s (%s) changed the event to %s", a.r.method, a.r.path, a.name, s)
				}
			}
		}
	}
	// Reads need credentials too unless anonymous reads are on.
	for _, path := range []string{"/api/v1/overview", "/console/", "/console/events", "/console/failures"} {
		if code, _ := f.do(req{method: "GET", path: path}); code != http.StatusUnauthorized {
			t.Errorf("anonymous GET %s: %d, want 401", path, code)
		}
		if code, _ := f.do(req{method: "GET", path: path, auth: "wrong"}); code != http.StatusUnauthorized {
			t.Errorf("GET %s with wrong credentials: %d, want 401", path, code)
		}
	}
}

var csrfRE = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

// csrfFor renders an event page as the caller auth and returns its form's
// CSRF token.
func csrfFor(t *testing.T, f *fixture, auth string) string {
	t.Helper()
	ev, err := f.ad.Events(f.ctx, admin.EventsOptions{State: admin.StatePending, Limit: 1})
	if err != nil || len(ev) == 0 {
		t.Fatalf("no event to render: %v", err)
	}
	code, body := f.do(req{method: "GET", path: fmt.Sprintf("/console/events/%d", ev[0].Seq), auth: auth})
	m := csrfRE.FindStringSubmatch(body)
	if code != http.StatusOK {
		t.Fatalf("event page: %d %s", code, short(body))
	}
	if m == nil {
		// Read-only pages have no forms; any well-formed token will do to
		// show that read-only refuses before it is looked at.
		return "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
	}
	return m[1]
}

func short(s string) string {
	if len(s) > 200 {
		return s[:200] + "..."
	}
	return s
}

// With anonymous reads, a reader without credentials sees every page but
// no action forms; the same page signed in has them.
func TestAnonymousReadsAndPages(t *testing.T) {
	f := newFixture(t, func(o *console.Options) { o.AnonymousReads = true })
	ids := f.write(uuid.NewString(), "order.placed", "order.paid")
	f.hold("permanent: topic \"x\" not found for %d", ids[0])
	pages := []struct{ path, want string }{
		{"/console/", "oldest pending"},
		{"/console/events?state=held", fmt.Sprintf(`href="/console/events/%d"`, ids[0])},
		{"/console/events?state=pending", fmt.Sprintf("waits for <a href=\"/console/events/%d\"", ids[0])},
		{fmt.Sprintf("/console/events/%d", ids[0]), "&#34;type&#34;: &#34;order.placed&#34;"},
		{"/console/failures", "permanent: topic &#34;…&#34; not found for &lt;n&gt;"},
		{fmt.Sprintf("/console/actions/retry?seq=%d", ids[0]), "will touch <strong>1</strong>"},
	}
	for _, p := range pages {
		code, body := f.do(req{method: "GET", path: p.path})
		if code != http.StatusOK || !strings.Contains(body, p.want) {
			t.Errorf("anonymous GET %s: %d, want 200 with %q\n%s", p.path, code, p.want, body)
		}
		if strings.Contains(body, `name="csrf"`) {
			t.Errorf("anonymous GET %s shows action forms", p.path)
		}
	}
	code, body := f.do(req{method: "GET", path: fmt.Sprintf("/console/events/%d", ids[0]), auth: "basic"})
	if code != http.StatusOK || !strings.Contains(body, `id="retry"`) || !strings.Contains(body, `name="csrf"`) {
		t.Errorf("signed-in event page lacks the retry form: %d", code)
	}
	if code, _ := f.do(req{method: "GET", path: "/console/", auth: "wrong"}); code != http.StatusUnauthorized {
		t.Errorf("wrong credentials with anonymous reads: %d, want 401", code)
	}
	if code, _ := f.do(req{method: "GET", path: "/console/login"}); code != http.StatusUnauthorized {
		t.Errorf("login without credentials: %d, want 401 asking for them", code)
	}
	if code, _ := f.do(req{method: "GET", path: "/console/static/style.css"}); code != http.StatusOK {
		t.Errorf("style sheet: %d", code)
	}
	hr, _ := http.NewRequest("GET", f.srv.URL+"/console/", nil)
	resp, err := http.DefaultClient.Do(hr)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if csp := resp.Header.Get("Content-Security-Policy"); !strings.Contains(csp, "default-src 'none'") || !strings.Contains(csp, "frame-ancestors 'none'") {
		t.Errorf("Content-Security-Policy %q", csp)
	}
	if cc := resp.Header.Get("Cache-Control"); cc != "no-store" {
		t.Errorf("Cache-Control %q, want no-store", cc)
	}
}

// A bulk action from a form goes to the confirmation page first, which
// shows the count; its form then acts.
func TestBulkActionNeedsConfirmation(t *testing.T) {
	f := newFixture(t, nil)
	ids := f.write(uuid.NewString(), "order.placed")
	more := f.write(uuid.NewString(), "order.placed")
	f.hold("permanent: no route %d", ids[0], more[0])
	tok := csrfFor(t, f, "basic")
	client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	hr, _ := http.NewRequest("POST", f.srv.URL+"/console/actions/retry", strings.NewReader("type=order.placed&csrf="+tok))
	hr.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	hr.SetBasicAuth(testUser, testPass)
	resp, err := client.Do(hr)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusSeeOther || !strings.HasPrefix(resp.Header.Get("Location"), "/console/actions/retry?") {
		t.Fatalf("unconfirmed bulk retry: %d to %q, want a redirect to the confirmation", resp.StatusCode, resp.Header.Get("Location"))
	}
	if f.state(ids[0]) != admin.StateHeld {
		t.Fatal("the unconfirmed bulk retry acted")
	}
	code, body := f.do(req{method: "GET", path: resp.Header.Get("Location"), auth: "basic"})
	if code != http.StatusOK || !strings.Contains(body, "will touch <strong>2</strong>") {
		t.Fatalf("confirmation page: %d\n%s", code, body)
	}
	form := url.Values{"confirmed": {"2"}, "csrf": {csrfRE.FindStringSubmatch(body)[1]}, "type": {"order.placed"}}
	code, body = f.do(req{method: "POST", path: "/console/actions/retry", body: form.Encode(),
		contentType: "application/x-www-form-urlencoded", auth: "basic"})
	if code != http.StatusOK || !strings.Contains(body, "2 events") {
		t.Fatalf("confirmed retry: %d\n%s", code, body)
	}
	if f.state(ids[0]) != admin.StatePending || f.state(more[0]) != admin.StatePending {
		t.Error("the confirmed retry did not release both events")
	}
}

func TestOptionsValidate(t *testing.T) {
	st := &admin.Admin{}
	for _, c := range []struct {
		o    console.Options
		want string
	}{
		{console.Options{}, "Admin"},
		{console.Options{Admin: st}, "no credentials"},
		{console.Options{Admin: st, Token: "short"}, "Token"},
		{console.Options{Admin: st, Username: "u"}, "go together"},
		{console.Options{Admin: st, Username: "u", Password: "short"}, "Password"},
		{console.Options{Admin: st, AnonymousReads: true, ActivityMinutes: 100000}, "ActivityMinutes"},
	} {
		if _, err := console.New(c.o); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("New(%+v) = %v, want an error naming %s", c.o, err, c.want)
		}
	}
	if _, err := console.New(console.Options{Admin: st, AnonymousReads: true}); err != nil {
		t.Errorf("anonymous read-only console: %v", err)
	}
}
