package console

import (
	"bytes"
	"embed"
	"fmt"
	"html/template"
	"io/fs"
	"math"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/outboxhq/outbox/store/admin"
)

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// pages holds one template set per page, each the layout with the page's
// content.
type pages struct {
	t map[string]*template.Template
}

var funcs = template.FuncMap{
	"neighbours": func() int { return admin.Neighbours },
	"bytes":      humanBytes,
	"window":     func() string { return thousands(admin.NeighbourWindow) },
	"ago":        agoSeconds,
	"since":      since,
	"ts":         timestamp,
	"pretty":     prettyJSON,
	"short":      short,
	"add":        func(a, b int) int { return a + b },
	"query": func(kv ...string) template.URL {
		v := url.Values{}
		for i := 0; i+1 < len(kv); i += 2 {
			if kv[i+1] != "" {
				v.Set(kv[i], kv[i+1])
			}
		}
		return template.URL(v.Encode())
	},
	"selq": func(s Selector) template.URL { return template.URL(s.values().Encode()) },
	"pct": func(part, whole float64) float64 {
		if whole <= 0 {
			return 0
		}
		return math.Min(100, 100*part/whole)
	},
}

func loadPages() (*pages, error) {
	names, err := fs.Glob(templateFS, "templates/*.html")
	if err != nil {
		return nil, fmt.Errorf("console templates: %w", err)
	}
	p := &pages{t: map[string]*template.Template{}}
	for _, n := range names {
		base := strings.TrimSuffix(strings.TrimPrefix(n, "templates/"), ".html")
		if base == "layout" {
			continue
		}
		t, err := template.New("layout.html").Funcs(funcs).ParseFS(templateFS, "templates/layout.html", n)
		if err != nil {
			return nil, fmt.Errorf("console template %s: %w", n, err)
		}
		p.t[base] = t
	}
	return p, nil
}

// view is what every page gets: the API response it shows in Data.
type view struct {
	Title  string
	Nav    string
	API    string // the API call that returns Data
	Access Access
	CSRF   string
	Data   any
}

// render writes the page; a template error (a bug) is a 500 before
// anything is sent, as the page is rendered to a buffer first.
func (c *Console) render(w http.ResponseWriter, r *http.Request, name string, v view) {
	v.Access = c.access(r)
	if v.Access.CanAct {
		v.CSRF = c.auth.csrfToken(who(r), time.Now())
	}
	var buf bytes.Buffer
	if err := c.pages.t[name].Execute(&buf, v); err != nil {
		c.opts.Logger.Error("console page failed", "page", name, "error", err)
		writeError(w, r, http.StatusInternalServerError, "render page: "+err.Error())
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	_, _ = buf.WriteTo(w)
}

// apiPath is the API call of the page at r.
func apiPath(r *http.Request) string {
	p := "/api/v1/" + strings.TrimPrefix(r.URL.Path, "/console/")
	if r.URL.Path == "/console/" {
		p = "/api/v1/overview"
	}
	if r.URL.RawQuery != "" {
		p += "?" + r.URL.RawQuery
	}
	return p
}

// overviewPage is the overview with its chart laid out.
type overviewPage struct {
	Overview
	Chart chart
}

func (c *Console) pageOverview(w http.ResponseWriter, r *http.Request) {
	o, err := c.overview(r)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	c.render(w, r, "overview", view{Title: "Overview", Nav: "overview", API: apiPath(r),
		Data: overviewPage{Overview: o, Chart: newChart(o.Activity)}})
}

// eventsPage is a listing with its states for the tabs and the selector
// its filters make, for acting on every match.
type eventsPage struct {
	Events
	States   []admin.EventState
	Selector *Selector // nil when the filters make none
	Next     template.URL
}

func (c *Console) pageEvents(w http.ResponseWriter, r *http.Request) {
	ev, err := c.events(r)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	p := eventsPage{Events: ev, States: admin.EventStates}
	q := ev.Query
	// The error-substring filter has no selector counterpart.
	if q.Error == "" && (q.Type != "" || q.AggregateID != "" || q.Fingerprint != "" || q.CreatedAfter != nil || q.CreatedBefore != nil) {
		p.Selector = &Selector{Type: q.Type, AggregateID: q.AggregateID, Fingerprint: q.Fingerprint,
			CreatedAfter: q.CreatedAfter, CreatedBefore: q.CreatedBefore}
	}
	if ev.NextAfter > 0 {
		v := r.URL.Query()
		v.Set("after", strconv.FormatInt(ev.NextAfter, 10))
		p.Next = template.URL(v.Encode())
	}
	c.render(w, r, "events", view{Title: "Events: " + q.State, Nav: "events", API: apiPath(r), Data: p})
}

func (c *Console) pageEvent(w http.ResponseWriter, r *http.Request) {
	d, err := c.event(r)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	c.render(w, r, "event", view{Title: fmt.Sprintf("Event %d", d.Seq), Nav: "events", API: apiPath(r), Data: d})
}

func (c *Console) pageFailures(w http.ResponseWriter, r *http.Request) {
	f, err := c.failures(r)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	c.render(w, r, "failures", view{Title: "Failures", Nav: "failures", API: apiPath(r), Data: f})
}

// confirmPage asks before an action, with the count it would touch.
type confirmPage struct {
	Preview
	Hidden url.Values // the selector, carried by the form
	Reason string
}

func (c *Console) pageConfirm(w http.ResponseWriter, r *http.Request) {
	p, err := c.preview(r)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	c.render(w, r, "confirm", view{Title: "Confirm " + p.Action, Nav: "events", API: apiPath(r),
		Data: confirmPage{Preview: p, Hidden: p.Selector.values(), Reason: r.URL.Query().Get("reason")}})
}

// pageAction runs a form's action. A bulk action must come from the
// confirmation page (its form sets confirmed); otherwise the browser is
// sent there first.
func (c *Console) pageAction(w http.ResponseWriter, r *http.Request) {
	action, err := parseAction(r)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	sel, err := selectorValues(r.PostForm)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	if sel.bulk() && r.PostForm.Get("confirmed") == "" {
		v := sel.values()
		if reason := r.PostForm.Get("reason"); reason != "" {
			v.Set("reason", reason)
		}
		http.Redirect(w, r, "/console/actions/"+string(action)+"?"+v.Encode(), http.StatusSeeOther)
		return
	}
	res, err := c.act(r, action, ActionRequest{Selector: sel, Reason: r.PostForm.Get("reason")})
	if err != nil {
		c.fail(w, r, err)
		return
	}
	c.render(w, r, "result", view{Title: "Done: " + res.Action, Nav: "events", API: "", Data: res})
}

// chart is the overview's activity as SVG bars, laid out here so the
// template only draws.
type chart struct {
	Width, Height, PlotHeight int
	FailTop, FailHeight       int
	MaxDispatched, MaxFailed  int64
	Bars                      []bar
	Labels                    []label
}

type bar struct {
	X, W             int
	Y, H, FY, FH     int
	Title            string
	Dispatched, Fail int64
}

type label struct {
	X    int
	Text string
}

func newChart(mins []Minute) chart {
	const (
		barW   = 10
		plotH  = 100
		failH  = 24
		margin = 6
	)
	c := chart{Width: max(len(mins), 1) * barW, PlotHeight: plotH, FailTop: plotH + margin, FailHeight: failH,
		Height: plotH + margin + failH + 14}
	for _, m := range mins {
		c.MaxDispatched = max(c.MaxDispatched, m.Dispatched)
		c.MaxFailed = max(c.MaxFailed, m.Failed)
	}
	scale := func(v, top int64, h int) int {
		if top == 0 || v == 0 {
			return 0
		}
		return max(1, int(math.Round(float64(v)/float64(top)*float64(h))))
	}
	for i, m := range mins {
		b := bar{X: i * barW, W: barW - 1, Dispatched: m.Dispatched, Fail: m.Failed,
			Title: fmt.Sprintf("%s UTC: %d dispatched, %d failing", m.Start.UTC().Format("15:04"), m.Dispatched, m.Failed)}
		b.H = scale(m.Dispatched, c.MaxDispatched, plotH)
		b.Y = plotH - b.H
		b.FH = scale(m.Failed, c.MaxFailed, failH)
		b.FY = c.FailTop + failH - b.FH
		c.Bars = append(c.Bars, b)
	}
	if n := len(mins); n > 0 {
		c.Labels = []label{{0, "-" + strconv.Itoa(n) + "m"}, {c.Width / 2, "-" + strconv.Itoa(n/2) + "m"}, {c.Width, "now"}}
	}
	return c
}

// agoSeconds renders an age in seconds for people: 850ms, 42s, 5m, 3m12s,
// 2h5m, 3.5d.
func agoSeconds(s float64) string {
	d := time.Duration(s * float64(time.Second))
	switch {
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < time.Hour:
		d = d.Round(time.Second)
	case d < 48*time.Hour:
		d = d.Round(time.Minute)
	default:
		return fmt.Sprintf("%.1fd", d.Hours()/24)
	}
	out := d.String()
	if strings.HasSuffix(out, "m0s") {
		out = strings.TrimSuffix(out, "0s")
	}
	if strings.HasSuffix(out, "h0m") {
		out = strings.TrimSuffix(out, "0m")
	}
	return out
}

func since(t *time.Time) string {
	if t == nil {
		return "-"
	}
	return agoSeconds(time.Since(*t).Seconds()) + " ago"
}

func timestamp(t any) string {
	switch v := t.(type) {
	case time.Time:
		return v.UTC().Format("2006-01-02 15:04:05 UTC")
	case *time.Time:
		if v == nil {
			return "-"
		}
		return v.UTC().Format("2006-01-02 15:04:05 UTC")
	}
	return fmt.Sprint(t)
}

func short(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) <= n {
		return s
	}
	for n > 0 && s[n]&0xC0 == 0x80 {
		n--
	}
	return s[:n] + "…"
}

// thousands writes n with commas between groups of three digits.
func thousands(n int) string {
	s := strconv.Itoa(n)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}

// humanBytes writes n as bytes, KiB or MiB.
func humanBytes(n int) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d bytes", n)
}
