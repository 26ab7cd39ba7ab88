package console

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"html"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/outboxhq/outbox/core/event"
	"github.com/outboxhq/outbox/store/admin"
)

// The API's responses. docs/operations.md documents them; the pages are
// rendered from the same values.

// Overview is GET /api/v1/overview.
type Overview struct {
	At                      time.Time  `json:"at"`
	Pending                 int64      `json:"pending"`
	Retrying                int64      `json:"retrying"`
	Scheduled               int64      `json:"scheduled"`
	Held                    int64      `json:"held"`
	Parked                  int64      `json:"parked"`
	Stuck                   int64      `json:"stuck"`
	StuckAfterSeconds       float64    `json:"stuck_after_seconds"`
	OldestPendingAgeSeconds float64    `json:"oldest_pending_age_seconds"`
	OldestPendingCreatedAt  *time.Time `json:"oldest_pending_created_at"`
	LagSLOSeconds           float64    `json:"lag_slo_seconds"`
	LagSLOBreached          bool       `json:"lag_slo_breached"`
	DispatchedLastMinute    int64      `json:"dispatched_last_minute"`
	Activity                []Minute   `json:"activity"`
	Relays                  []Relay    `json:"relays"`
	Access                  Access     `json:"access"`
}

// Minute is one minute of the activity chart.
type Minute struct {
	Start      time.Time `json:"start"`
	Dispatched int64     `json:"dispatched"`
	Failed     int64     `json:"failed"`
}

// Relay is one relay process seen connected to the database.
type Relay struct {
	Client             string     `json:"client"`
	Connections        int        `json:"connections"`
	InClaim            int        `json:"in_claim"`
	OldestClaimSeconds float64    `json:"oldest_claim_seconds"`
	LastQueryAt        *time.Time `json:"last_query_at"`
	LastQuerySeconds   float64    `json:"last_query_seconds"`
	// Local marks the relay serving this console; LastProgressAt is when
	// it last completed a claim cycle.
	Local          bool       `json:"local"`
	LastProgressAt *time.Time `json:"last_progress_at,omitempty"`
}

// Access says what the caller may do.
type Access struct {
	User     string `json:"user,omitempty"` // "" for an anonymous reader
	ReadOnly bool   `json:"read_only"`
	CanAct   bool   `json:"can_act"`
}

// Event is one event in a listing.
type Event struct {
	Seq          int64      `json:"seq"`      // position in the table
	ID           string     `json:"event_id"` // identity, a UUID
	AggregateID  string     `json:"aggregate_id"`
	Type         string     `json:"type"`
	State        string     `json:"state"`
	CreatedAt    time.Time  `json:"created_at"`
	AgeSeconds   float64    `json:"age_seconds"`
	DispatchedAt *time.Time `json:"dispatched_at,omitempty"`
	Attempts     int        `json:"attempts"`
	LastError    string     `json:"last_error,omitempty"`
	FailedAt     *time.Time `json:"failed_at,omitempty"`
	RetryAt      *time.Time `json:"retry_at,omitempty"`
	DeliverAt    *time.Time `json:"deliver_at,omitempty"`
	ParkedAt     *time.Time `json:"parked_at,omitempty"`
	ParkedReason string     `json:"parked_reason,omitempty"`
	HeldBack     int64      `json:"held_back"`
	WaitsFor     int64      `json:"waits_for,omitempty"`
}

// Events is GET /api/v1/events.
type Events struct {
	Query  EventsQuery `json:"query"`
	Events []Event     `json:"events"`
	// NextAfter, when not zero, is the after parameter of the next page.
	NextAfter int64 `json:"next_after,omitempty"`
}

// EventsQuery echoes the listing's parameters.
type EventsQuery struct {
	State         string     `json:"state"`
	Type          string     `json:"type,omitempty"`
	AggregateID   string     `json:"aggregate_id,omitempty"`
	Error         string     `json:"error,omitempty"`
	Fingerprint   string     `json:"fingerprint,omitempty"`
	CreatedAfter  *time.Time `json:"created_after,omitempty"`
	CreatedBefore *time.Time `json:"created_before,omitempty"`
	After         int64      `json:"after,omitempty"`
	Limit         int        `json:"limit"`
}

// EventDetail is GET /api/v1/events/{id}: one event with its content.
type EventDetail struct {
	Event
	// Payload is a JSON payload as stored; PayloadHex holds any other
	// (Protobuf, Avro, raw bytes), of ContentType.
	Payload    json.RawMessage `json:"payload,omitempty"`
	PayloadHex string          `json:"payload_hex,omitempty"`
	// PayloadBytes is the payload's size. Over PayloadPreviewBytes the
	// payload is left out (a held 4 MB row would make a 4 MB page):
	// PayloadPreview has its first PayloadPreviewBytes (as text for JSON,
	// else as hex) and PayloadURL downloads it whole.
	PayloadBytes     int             `json:"payload_bytes"`
	PayloadTruncated bool            `json:"payload_truncated,omitempty"`
	PayloadPreview   string          `json:"payload_preview,omitempty"`
	PayloadURL       string          `json:"payload_url"`
	ContentType      string          `json:"content_type"`
	Headers          json.RawMessage `json:"headers"`
	// Before and After are the nearest events of the same aggregate.
	Before []Event `json:"before"`
	After  []Event `json:"after"`
}

// Failures is GET /api/v1/failures.
type Failures struct {
	Groups []FailureGroup `json:"groups"`
}

// FailureGroup is the events failing with one error fingerprint.
type FailureGroup struct {
	Fingerprint string     `json:"fingerprint"`
	Example     string     `json:"example"`
	ExampleSeq  int64      `json:"example_seq"`
	Events      int64      `json:"events"`
	Held        int64      `json:"held"`
	Retrying    int64      `json:"retrying"`
	Parked      int64      `json:"parked"`
	Types       []string   `json:"types"`
	FirstSeen   *time.Time `json:"first_seen"`
	LastSeen    *time.Time `json:"last_seen"`
}

// Selector names the events of an action, as admin.Selector does; set
// fields combine with AND and at least one is required.
type Selector struct {
	Seqs          []int64    `json:"seqs,omitempty"`
	FromSeq       int64      `json:"from_seq,omitempty"`
	ToSeq         int64      `json:"to_seq,omitempty"`
	AggregateID   string     `json:"aggregate_id,omitempty"`
	Type          string     `json:"type,omitempty"`
	CreatedAfter  *time.Time `json:"created_after,omitempty"`
	CreatedBefore *time.Time `json:"created_before,omitempty"`
	Fingerprint   string     `json:"fingerprint,omitempty"`
}

// ActionRequest is the body of POST /api/v1/actions/{action}.
type ActionRequest struct {
	Selector
	Reason string `json:"reason,omitempty"` // park: required
}

// Preview is GET /api/v1/actions/{action}: what the action would touch.
type Preview struct {
	Action      string   `json:"action"`
	Selector    Selector `json:"selector"`
	Description string   `json:"description"`
	Count       int64    `json:"count"`
	// More: more events match than one call touches (run it again for the
	// rest), or, for replay, than the count goes up to.
	More bool `json:"more"`
}

// ActionResult is the response of POST /api/v1/actions/{action}.
type ActionResult struct {
	Action      string   `json:"action"`
	Selector    Selector `json:"selector"`
	Description string   `json:"description"`
	Count       int64    `json:"count"` // events the action touched
	More        bool     `json:"more"`  // retry, park, unpark: the per-call maximum was reached
}

// errorBody is every error response.
type errorBody struct {
	Error string `json:"error"`
}

// httpError is an error with the status it answers with.
type httpError struct {
	status int
	msg    string
}

func (e *httpError) Error() string { return e.msg }

func badRequest(format string, a ...any) error {
	return &httpError{http.StatusBadRequest, fmt.Sprintf(format, a...)}
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

// writeError answers msg with status: JSON for the API, a plain page for
// the console.
func writeError(w http.ResponseWriter, r *http.Request, status int, msg string) {
	if strings.HasPrefix(r.URL.Path, "/console") {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		w.WriteHeader(status)
		fmt.Fprintf(w, "<!doctype html><meta charset=utf-8><title>%d</title><link rel=stylesheet href=\"/console/static/style.css\">"+
			"<main><h1>%d %s</h1><p class=error>%s</p><p><a href=\"/console/\">Overview</a></p></main>\n",
			status, status, html.EscapeString(http.StatusText(status)), html.EscapeString(msg))
		return
	}
	writeJSON(w, status, errorBody{Error: msg})
}

// fail answers an error: its own status for an httpError, 404 for a
// missing event, else 500, logged.
func (c *Console) fail(w http.ResponseWriter, r *http.Request, err error) {
	status, msg := c.errorStatus(r, err)
	writeError(w, r, status, msg)
}

func (c *Console) errorStatus(r *http.Request, err error) (int, string) {
	var he *httpError
	switch {
	case errors.As(err, &he):
		return he.status, he.msg
	case errors.Is(err, admin.ErrEventNotFound):
		return http.StatusNotFound, err.Error()
	case errors.Is(err, context.Canceled):
		return 499, "request canceled"
	}
	c.opts.Logger.Error("console request failed", "path", r.URL.Path, "error", err)
	return http.StatusInternalServerError, err.Error()
}

func ptr(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	return &t
}

func (c *Console) access(r *http.Request) Access {
	u := who(r)
	return Access{User: u, ReadOnly: c.opts.ReadOnly, CanAct: u != "" && !c.opts.ReadOnly}
}

// overview reads the status, the activity and the relays.
func (c *Console) overview(r *http.Request) (Overview, error) {
	ctx := r.Context()
	st, err := c.opts.Admin.Status(ctx, admin.StatusOptions{StuckAfter: c.opts.StuckAfter, RelayApplication: c.opts.RelayApplication})
	if err != nil {
		return Overview{}, err
	}
	act, err := c.opts.Admin.Activity(ctx, c.opts.ActivityMinutes)
	if err != nil {
		return Overview{}, err
	}
	o := Overview{
		At: st.Now, Pending: st.Pending, Retrying: st.Retrying, Scheduled: st.Scheduled, Held: st.Held, Parked: st.Parked, Stuck: st.Stuck,
		StuckAfterSeconds: c.opts.StuckAfter.Seconds(), OldestPendingAgeSeconds: st.OldestPendingAge.Seconds(),
		OldestPendingCreatedAt: ptr(st.OldestPending), LagSLOSeconds: c.opts.LagSLO.Seconds(),
		LagSLOBreached: st.OldestPendingAge > c.opts.LagSLO, DispatchedLastMinute: st.DispatchedLastMinute,
		Activity: make([]Minute, len(act)), Relays: []Relay{}, Access: c.access(r),
	}
	for i, m := range act {
		o.Activity[i] = Minute{Start: m.Start, Dispatched: m.Dispatched, Failed: m.Failed}
	}
	var localName string
	var localProgress time.Time
	if c.opts.LocalRelay != nil {
		localName, localProgress = c.opts.LocalRelay()
	}
	for _, rep := range st.Replicas {
		rl := Relay{Client: rep.Client, Connections: rep.Connections, InClaim: rep.InClaim, LastQueryAt: ptr(rep.LastQuery)}
		if !rep.OldestClaim.IsZero() {
			rl.OldestClaimSeconds = max(st.Now.Sub(rep.OldestClaim), 0).Seconds()
		}
		if !rep.LastQuery.IsZero() {
			rl.LastQuerySeconds = max(st.Now.Sub(rep.LastQuery), 0).Seconds()
		}
		if localName != "" && rep.Client == localName {
			rl.Local, rl.LastProgressAt = true, ptr(localProgress)
		}
		o.Relays = append(o.Relays, rl)
	}
	return o, nil
}

func (c *Console) apiOverview(w http.ResponseWriter, r *http.Request) {
	o, err := c.overview(r)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, o)
}

func toEvent(e admin.EventInfo, now time.Time) Event {
	return Event{
		Seq: e.Seq, ID: e.ID, AggregateID: e.AggregateID, Type: e.Type, State: string(e.State()),
		CreatedAt: e.CreatedAt, AgeSeconds: max(now.Sub(e.CreatedAt), 0).Seconds(), DispatchedAt: ptr(e.DispatchedAt),
		Attempts: e.Attempts, LastError: e.LastError, FailedAt: ptr(e.FailedAt), RetryAt: ptr(e.RetryAt), DeliverAt: ptr(e.DeliverAt),
		ParkedAt: ptr(e.ParkedAt), ParkedReason: e.ParkedReason, HeldBack: e.HeldBack, WaitsFor: e.WaitsFor,
	}
}

// parseTime reads a time parameter: RFC 3339, a form's datetime-local
// (2006-01-02T15:04, taken as UTC), a date, or a duration ago ("36h").
func parseTime(field, v string, now time.Time) (*time.Time, error) {
	v = strings.TrimSpace(v)
	if v == "" {
		return nil, nil
	}
	for _, layout := range []string{time.RFC3339Nano, "2006-01-02T15:04:05", "2006-01-02T15:04", "2006-01-02"} {
		if t, err := time.ParseInLocation(layout, v, time.UTC); err == nil {
			return &t, nil
		}
	}
	if d, err := time.ParseDuration(v); err == nil && d > 0 {
		t := now.Add(-d)
		return &t, nil
	}
	return nil, badRequest("%s: %q is not an RFC 3339 time, a date or a duration ago such as 36h", field, v)
}

func parseInt(field, v string) (int64, error) {
	if v = strings.TrimSpace(v); v == "" {
		return 0, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 {
		return 0, badRequest("%s: %q is not a non-negative integer", field, v)
	}
	return n, nil
}

// eventsQuery reads a listing's parameters.
func (c *Console) eventsQuery(v url.Values) (admin.EventsOptions, EventsQuery, error) {
	now := time.Now()
	q := admin.EventsOptions{
		State: admin.EventState(v.Get("state")), StuckAfter: c.opts.StuckAfter, Type: v.Get("type"),
		AggregateID: strings.TrimSpace(v.Get("aggregate")), Error: v.Get("error"), Fingerprint: v.Get("fingerprint"),
	}
	if q.State == "" {
		q.State = admin.StateStuck
	}
	valid := false
	for _, s := range admin.EventStates {
		valid = valid || s == q.State
	}
	if !valid {
		return q, EventsQuery{}, badRequest("state: %q is not one of %s", q.State, states())
	}
	if q.AggregateID != "" {
		if err := event.CheckKey(q.AggregateID); err != nil {
			return q, EventsQuery{}, badRequest("aggregate: %v", err)
		}
	}
	after, err := parseTime("created_after", v.Get("created_after"), now)
	if err != nil {
		return q, EventsQuery{}, err
	}
	before, err := parseTime("created_before", v.Get("created_before"), now)
	if err != nil {
		return q, EventsQuery{}, err
	}
	if after != nil {
		q.CreatedAfter = *after
	}
	if before != nil {
		q.CreatedBefore = *before
	}
	if q.After, err = parseInt("after", v.Get("after")); err != nil {
		return q, EventsQuery{}, err
	}
	q.Limit = admin.DefaultEventsLimit
	if s := v.Get("limit"); strings.TrimSpace(s) != "" {
		limit, err := parseInt("limit", s)
		if err != nil {
			return q, EventsQuery{}, err
		}
		if limit < 1 || limit > admin.MaxEventsLimit {
			return q, EventsQuery{}, badRequest("limit: %d is not between 1 and %d", limit, admin.MaxEventsLimit)
		}
		q.Limit = int(limit)
	}
	echo := EventsQuery{State: string(q.State), Type: q.Type, AggregateID: q.AggregateID, Error: q.Error,
		Fingerprint: q.Fingerprint, CreatedAfter: after, CreatedBefore: before, After: q.After, Limit: q.Limit}
	return q, echo, nil
}

func states() string {
	s := make([]string, len(admin.EventStates))
	for i, st := range admin.EventStates {
		s[i] = string(st)
	}
	return strings.Join(s, ", ")
}

func (c *Console) events(r *http.Request) (Events, error) {
	q, echo, err := c.eventsQuery(r.URL.Query())
	if err != nil {
		return Events{}, err
	}
	page, err := c.opts.Admin.EventsPage(r.Context(), q)
	list := page.Events
	if err != nil {
		if errors.Is(err, admin.ErrInvalid) {
			return Events{}, badRequest("%v", err)
		}
		return Events{}, err
	}
	out := Events{Query: echo, Events: make([]Event, len(list))}
	now := time.Now()
	for i, e := range list {
		out.Events[i] = toEvent(e, now)
	}
	out.NextAfter = page.NextAfter
	return out, nil
}

func (c *Console) apiEvents(w http.ResponseWriter, r *http.Request) {
	ev, err := c.events(r)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, ev)
}

// PayloadPreviewBytes is the most of a payload an event's page and JSON
// carry; the rest is downloaded (GET /api/v1/events/{ref}/payload).
const PayloadPreviewBytes = 64 << 10

// apiPayload sends an event's payload whole, as a download: never rendered
// by the browser in the console's origin, whatever its content type.
func (c *Console) apiPayload(w http.ResponseWriter, r *http.Request) {
	seq, id, err := eventRef(r)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	d, err := c.opts.Admin.Event(r.Context(), seq, id)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	ext := ".bin"
	if event.IsJSON(d.ContentType) {
		ext = ".json"
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Disposition", fmt.Sprintf(`attachment; filename="event-%d%s"`, d.Seq, ext))
	w.Header().Set("Content-Length", strconv.Itoa(len(d.Payload)))
	_, _ = w.Write(d.Payload)
}

// eventRef reads the event named by the path: its seq, or its event id.
func eventRef(r *http.Request) (seq int64, id string, err error) {
	ref := r.PathValue("ref")
	if n, err := strconv.ParseInt(ref, 10, 64); err == nil && n > 0 {
		return n, "", nil
	}
	if len(ref) == 36 && strings.Count(ref, "-") == 4 {
		return 0, ref, nil
	}
	return 0, "", badRequest("event %q: give its seq (a positive number) or its event id (a UUID)", ref)
}

// event reads the event named by the path: its seq, or its event id.
func (c *Console) event(r *http.Request) (EventDetail, error) {
	seq, id, err := eventRef(r)
	if err != nil {
		return EventDetail{}, err
	}
	d, err := c.opts.Admin.Event(r.Context(), seq, id)
	if err != nil {
		if errors.Is(err, admin.ErrInvalid) {
			return EventDetail{}, badRequest("%v", err)
		}
		return EventDetail{}, err
	}
	now := time.Now()
	out := EventDetail{Event: toEvent(d.EventInfo, now), Before: []Event{}, After: []Event{}, Headers: json.RawMessage("null")}
	out.ContentType = d.ContentType
	if out.ContentType == "" {
		out.ContentType = event.ContentTypeJSON
	}
	out.PayloadBytes = len(d.Payload)
	out.PayloadURL = fmt.Sprintf("/api/v1/events/%d/payload", d.Seq)
	isJSON := event.IsJSON(d.ContentType)
	switch {
	case len(d.Payload) > PayloadPreviewBytes && isJSON:
		out.PayloadTruncated, out.PayloadPreview = true, strings.ToValidUTF8(string(d.Payload[:PayloadPreviewBytes]), "")
	case len(d.Payload) > PayloadPreviewBytes:
		out.PayloadTruncated, out.PayloadPreview = true, hex.EncodeToString(d.Payload[:PayloadPreviewBytes/2])
	case isJSON && json.Valid(d.Payload):
		out.Payload = d.Payload
	default:
		out.PayloadHex = hex.EncodeToString(d.Payload)
	}
	if d.Headers != nil && json.Valid(d.Headers) {
		out.Headers = d.Headers
	}
	for _, e := range d.Before {
		out.Before = append(out.Before, toEvent(e, now))
	}
	for _, e := range d.After {
		out.After = append(out.After, toEvent(e, now))
	}
	return out, nil
}

func (c *Console) apiEvent(w http.ResponseWriter, r *http.Request) {
	d, err := c.event(r)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, d)
}

func (c *Console) failures(r *http.Request) (Failures, error) {
	groups, err := c.opts.Admin.Failures(r.Context())
	if err != nil {
		return Failures{}, err
	}
	out := Failures{Groups: make([]FailureGroup, len(groups))}
	for i, g := range groups {
		out.Groups[i] = FailureGroup{Fingerprint: g.Fingerprint, Example: g.Example, ExampleSeq: g.ExampleSeq,
			Events: g.Events, Held: g.Held, Retrying: g.Retrying, Parked: g.Parked, Types: g.Types,
			FirstSeen: ptr(g.FirstSeen), LastSeen: ptr(g.LastSeen)}
		if out.Groups[i].Types == nil {
			out.Groups[i].Types = []string{}
		}
	}
	return out, nil
}

func (c *Console) apiFailures(w http.ResponseWriter, r *http.Request) {
	f, err := c.failures(r)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, f)
}

// selectorValues reads a selector from query or form values.
func selectorValues(v url.Values) (Selector, error) {
	var sel Selector
	now := time.Now()
	for _, list := range v["seq"] {
		for part := range strings.SplitSeq(list, ",") {
			if part = strings.TrimSpace(part); part == "" {
				continue
			}
			seq, err := strconv.ParseInt(part, 10, 64)
			if err != nil || seq <= 0 {
				return sel, badRequest("seq: %q is not an event position", part)
			}
			sel.Seqs = append(sel.Seqs, seq)
		}
	}
	var err error
	if sel.FromSeq, err = parseInt("from_seq", v.Get("from_seq")); err != nil {
		return sel, err
	}
	if sel.ToSeq, err = parseInt("to_seq", v.Get("to_seq")); err != nil {
		return sel, err
	}
	sel.AggregateID = strings.TrimSpace(v.Get("aggregate"))
	sel.Type = strings.TrimSpace(v.Get("type"))
	sel.Fingerprint = v.Get("fingerprint")
	if sel.CreatedAfter, err = parseTime("created_after", v.Get("created_after"), now); err != nil {
		return sel, err
	}
	if sel.CreatedBefore, err = parseTime("created_before", v.Get("created_before"), now); err != nil {
		return sel, err
	}
	return sel, nil
}

func (s Selector) store() admin.Selector {
	out := admin.Selector{Seqs: s.Seqs, FromSeq: s.FromSeq, ToSeq: s.ToSeq, AggregateID: s.AggregateID, Type: s.Type, Fingerprint: s.Fingerprint}
	if s.CreatedAfter != nil {
		out.CreatedAfter = *s.CreatedAfter
	}
	if s.CreatedBefore != nil {
		out.CreatedBefore = *s.CreatedBefore
	}
	return out
}

// values is the selector as query parameters, for links and forms.
func (s Selector) values() url.Values {
	v := url.Values{}
	for _, seq := range s.Seqs {
		v.Add("seq", strconv.FormatInt(seq, 10))
	}
	set := func(k, val string) {
		if val != "" {
			v.Set(k, val)
		}
	}
	if s.FromSeq > 0 {
		set("from_seq", strconv.FormatInt(s.FromSeq, 10))
	}
	if s.ToSeq > 0 {
		set("to_seq", strconv.FormatInt(s.ToSeq, 10))
	}
	set("aggregate", s.AggregateID)
	set("type", s.Type)
	set("fingerprint", s.Fingerprint)
	if s.CreatedAfter != nil {
		set("created_after", s.CreatedAfter.UTC().Format(time.RFC3339))
	}
	if s.CreatedBefore != nil {
		set("created_before", s.CreatedBefore.UTC().Format(time.RFC3339))
	}
	return v
}

// bulk reports whether the selector can name more than one event; such
// actions go through a confirmation page in the console.
func (s Selector) bulk() bool {
	one := len(s.Seqs) == 1 || (s.FromSeq > 0 && s.FromSeq == s.ToSeq)
	return !one
}

func parseAction(r *http.Request) (admin.Action, error) {
	a := admin.Action(r.PathValue("action"))
	for _, known := range admin.Actions {
		if a == known {
			return a, nil
		}
	}
	return "", &httpError{http.StatusNotFound, fmt.Sprintf("action %q is not retry, park, unpark or replay", a)}
}

func (c *Console) preview(r *http.Request) (Preview, error) {
	action, err := parseAction(r)
	if err != nil {
		return Preview{}, err
	}
	sel, err := selectorValues(r.URL.Query())
	if err != nil {
		return Preview{}, err
	}
	ss := sel.store()
	if err := ss.Validate(); err != nil {
		return Preview{}, badRequest("%v", err)
	}
	n, err := c.opts.Admin.Affected(r.Context(), action, ss)
	if err != nil {
		return Preview{}, err
	}
	return Preview{Action: string(action), Selector: sel, Description: ss.String(), Count: n.Count, More: n.More}, nil
}

func (c *Console) apiPreview(w http.ResponseWriter, r *http.Request) {
	p, err := c.preview(r)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, p)
}

// act runs an action; the API and the console's forms both come here.
func (c *Console) act(r *http.Request, action admin.Action, req ActionRequest) (ActionResult, error) {
	ss := req.store()
	if err := ss.Validate(); err != nil {
		return ActionResult{}, badRequest("%v", err)
	}
	reason := strings.TrimSpace(req.Reason)
	if action == admin.ActionPark && reason == "" {
		return ActionResult{}, badRequest("reason: parking needs a reason")
	}
	ctx := r.Context()
	var (
		n   int64
		err error
	)
	switch action {
	case admin.ActionRetry:
		n, err = c.opts.Admin.Retry(ctx, ss)
	case admin.ActionPark:
		n, err = c.opts.Admin.Park(ctx, ss, reason)
	case admin.ActionUnpark:
		n, err = c.opts.Admin.Unpark(ctx, ss)
	case admin.ActionReplay:
		n, err = c.opts.Admin.Replay(ctx, ss, admin.ReplayOptions{})
	}
	if err != nil {
		if errors.Is(err, admin.ErrInvalid) {
			return ActionResult{}, badRequest("%v", err)
		}
		if n > 0 {
			err = fmt.Errorf("%w (%d events done before the error)", err, n)
		}
		return ActionResult{}, err
	}
	c.opts.Logger.Info("console action", "action", string(action), "user", who(r), "selector", ss.String(), "count", n)
	return ActionResult{Action: string(action), Selector: req.Selector, Description: ss.String(), Count: n,
		More: action != admin.ActionReplay && n == admin.MaxSelected}, nil
}

func (c *Console) apiAction(w http.ResponseWriter, r *http.Request) {
	action, err := parseAction(r)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	var req ActionRequest
	dec := json.NewDecoder(r.Body)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		c.fail(w, r, badRequest("request body: %v", err))
		return
	}
	if dec.More() {
		c.fail(w, r, badRequest("request body: more than one JSON value"))
		return
	}
	res, err := c.act(r, action, req)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, res)
}

// prettyJSON indents a JSON document for the page, or returns it as it is.
func prettyJSON(b []byte) string {
	var out bytes.Buffer
	if err := json.Indent(&out, b, "", "  "); err != nil {
		return string(b)
	}
	return out.String()
}
