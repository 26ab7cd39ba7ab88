// Package console is the outbox's operator console and its JSON API: the
// backlog and the relays at a glance, held, backing-off, stuck and parked
// events with their aggregate's chain, failures grouped by error, one
// event's payload and neighbours, and the actions retry, park, unpark and
// replay. `outbox relay` serves it on http.listen and `outbox console`
// without a relay; a program of its own mounts the handler New returns.
//
// Pages are rendered on the server with html/template from embedded files
// and work without JavaScript. Each page renders the response of the API
// call of the same name (GET /console/events is GET /api/v1/events), so
// the console shows nothing the API does not say.
//
// Access: reads need credentials unless Options.AnonymousReads is set;
// actions always need them (a bearer token or basic-auth username and
// password), are refused in read-only mode, are never run by a GET, and
// are checked against cross-site requests: the browser's Fetch metadata or
// Origin, a CSRF token in every form, and a JSON content type on the API.
package console

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/admin"
)

// Admin is what the console reads and acts on; *admin.Admin is one.
type Admin interface {
	Status(ctx context.Context, opts admin.StatusOptions) (admin.Status, error)
	EventsPage(ctx context.Context, q admin.EventsOptions) (admin.EventsPage, error)
	Event(ctx context.Context, seq int64, id string) (admin.EventDetail, error)
	Failures(ctx context.Context) ([]admin.FailureGroup, error)
	Activity(ctx context.Context, minutes int) ([]admin.Minute, error)
	Affected(ctx context.Context, action admin.Action, sel admin.Selector) (admin.Affected, error)
	Retry(ctx context.Context, sel admin.Selector) (int64, error)
	Park(ctx context.Context, sel admin.Selector, reason string) (int64, error)
	Unpark(ctx context.Context, sel admin.Selector) (int64, error)
	Replay(ctx context.Context, sel admin.Selector, opts admin.ReplayOptions) (int64, error)
}

var _ Admin = (*admin.Admin)(nil)

// Options configure New.
type Options struct {
	Admin  Admin        // required
	Logger *slog.Logger // default: discard

	// Token, when set, authorizes requests with "Authorization: Bearer
	// <token>": for scripts and the API. Username and Password, when set,
	// authorize basic-auth requests: for browsers. Set at least one, or
	// AnonymousReads with no actions.
	Token              string
	Username, Password string
	// AnonymousReads lets requests without credentials read (every GET);
	// actions still need credentials.
	AnonymousReads bool
	// ReadOnly refuses every action, whoever asks.
	ReadOnly bool

	// StuckAfter is the age from which a pending event is stuck; default
	// store.DefaultStuckAge.
	StuckAfter time.Duration
	// LagSLO is the oldest pending age the overview measures against;
	// default 60s, the OutboxLagSLOBreached alert's threshold.
	LagSLO time.Duration
	// RelayApplication is the application_name relays connect with, to
	// list them; default "outbox-relay".
	RelayApplication string
	// LocalRelay, when set, reports the relay running in this process: its
	// name (host:pid) and when it last completed a claim cycle.
	LocalRelay func() (name string, lastProgress time.Time)
	// ActivityMinutes is the overview chart's window; default 60.
	ActivityMinutes int
}

// Default values of Options.
const (
	DefaultLagSLO           = 60 * time.Second
	DefaultRelayApplication = "outbox-relay"
	DefaultActivityMinutes  = 60
	MinSecretBytes          = 16 // shortest Token or Password accepted
)

// WithDefaults returns o with unset fields at their defaults.
func (o Options) WithDefaults() Options {
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.StuckAfter == 0 {
		o.StuckAfter = store.DefaultStuckAge
	}
	if o.LagSLO == 0 {
		o.LagSLO = DefaultLagSLO
	}
	if o.RelayApplication == "" {
		o.RelayApplication = DefaultRelayApplication
	}
	if o.ActivityMinutes == 0 {
		o.ActivityMinutes = DefaultActivityMinutes
	}
	return o
}

// Validate reports what is wrong with o, naming the field.
func (o Options) Validate() error {
	var errs []error
	switch {
	case o.Admin == nil:
		errs = append(errs, errors.New("console: Admin is nil"))
	case o.Token == "" && o.Username == "" && !o.AnonymousReads:
		errs = append(errs, errors.New("console: no credentials: set Token, Username and Password, or AnonymousReads for a console anyone can read and no one can act in"))
	}
	if o.Token != "" && len(o.Token) < MinSecretBytes {
		errs = append(errs, fmt.Errorf("console: Token is %d bytes; use at least %d random bytes", len(o.Token), MinSecretBytes))
	}
	if (o.Username == "") != (o.Password == "") {
		errs = append(errs, errors.New("console: Username and Password go together"))
	}
	if o.Password != "" && len(o.Password) < MinSecretBytes {
		errs = append(errs, fmt.Errorf("console: Password is %d bytes; use at least %d", len(o.Password), MinSecretBytes))
	}
	if o.StuckAfter < 0 || o.LagSLO < 0 {
		errs = append(errs, errors.New("console: StuckAfter and LagSLO must not be negative"))
	}
	if o.ActivityMinutes < 0 || o.ActivityMinutes > admin.MaxActivityMinutes {
		errs = append(errs, fmt.Errorf("console: ActivityMinutes %d is not between 1 and %d", o.ActivityMinutes, admin.MaxActivityMinutes))
	}
	return errors.Join(errs...)
}

// Console serves the console pages under /console/ and the API under
// /api/v1/.
type Console struct {
	opts  Options
	auth  *auth
	pages *pages
	mux   *http.ServeMux
}

// New returns the console for opts.
func New(opts Options) (*Console, error) {
	opts = opts.WithDefaults()
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	p, err := loadPages()
	if err != nil {
		return nil, err
	}
	c := &Console{opts: opts, auth: newAuth(opts), pages: p, mux: http.NewServeMux()}
	c.routes()
	return c, nil
}

// allowed returns the methods, other than r's, that a route of the API
// takes on r's path ("GET, POST"), or "" when the path is none of them.
func (c *Console) allowed(r *http.Request) string {
	var allow []string
	for _, m := range []string{http.MethodGet, http.MethodPost} {
		if m == r.Method {
			continue
		}
		probe := r.Clone(r.Context())
		probe.Method = m
		if _, pattern := c.mux.Handler(probe); pattern != "" && pattern != "/api/v1/" {
			allow = append(allow, m)
		}
	}
	return strings.Join(allow, ", ")
}

// noListing answers 404 for a folder, which a file server would list.
func noListing(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/") {
			http.NotFound(w, r)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// Paths lists the path prefixes the console serves, for a caller mounting
// it beside other handlers.
var Paths = []string{"/console/", "/api/v1/"}

// ServeHTTP implements http.Handler.
func (c *Console) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	securityHeaders(w.Header())
	c.mux.ServeHTTP(w, r)
}

func (c *Console) routes() {
	read, write := c.auth.read, c.auth.write
	m := c.mux
	m.Handle("GET /api/v1/overview", read(c.apiOverview))
	m.Handle("GET /api/v1/events", read(c.apiEvents))
	m.Handle("GET /api/v1/events/{ref}", read(c.apiEvent))
	m.Handle("GET /api/v1/events/{ref}/payload", read(c.apiPayload))
	m.Handle("GET /api/v1/failures", read(c.apiFailures))
	m.Handle("GET /api/v1/actions/{action}", read(c.apiPreview))
	m.Handle("POST /api/v1/actions/{action}", write(c.apiAction, apiRequest))
	m.HandleFunc("/api/v1/", func(w http.ResponseWriter, r *http.Request) {
		if allow := c.allowed(r); allow != "" {
			w.Header().Set("Allow", allow)
			writeError(w, r, http.StatusMethodNotAllowed, r.Method+" is not allowed on "+r.URL.Path+" (allowed: "+allow+")")
			return
		}
		writeError(w, r, http.StatusNotFound, "no such API path: "+r.URL.Path)
	})

	m.Handle("GET /console/{$}", read(c.pageOverview))
	m.Handle("GET /console/events", read(c.pageEvents))
	m.Handle("GET /console/events/{ref}", read(c.pageEvent))
	m.Handle("GET /console/failures", read(c.pageFailures))
	m.Handle("GET /console/actions/{action}", read(c.pageConfirm))
	m.Handle("POST /console/actions/{action}", write(c.pageAction, formRequest))
	m.Handle("GET /console/login", c.auth.login())
	m.Handle("GET /console/static/", http.StripPrefix("/console/", noListing(http.FileServerFS(staticFS))))
	m.HandleFunc("GET /console", func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, "/console/", http.StatusMovedPermanently)
	})
}
