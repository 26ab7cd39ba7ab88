package metrics_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/metrics"
	"github.com/outboxhq/outbox/internal/memsource"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store/table"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// failingPublisher fails events of the types in fail permanently and
// counts the rest.
type failingPublisher struct {
	fail map[string]bool
	ok   atomic.Int64
}

func (p *failingPublisher) Publish(_ context.Context, e *core.Event) error {
	if p.fail[e.Type] {
		return core.Permanent(errors.New("rejected by broker"))
	}
	p.ok.Add(1)
	return nil
}

func (p *failingPublisher) Close() error { return nil }

func TestObserverAfterKnownRun(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	obs, err := metrics.NewObserver(metrics.Options{Registerer: reg, Broker: "kafka"})
	if err != nil {
		t.Fatal(err)
	}
	ms := memsource.New()
	created := time.Now().Add(-2 * time.Second)
	var events []core.Event
	for i := range 10 {
		typ := "order.placed"
		if i%3 == 0 {
			typ = "invoice.sent"
		}
		events = append(events, core.Event{AggregateID: uuid.NewString(), Type: typ, CreatedAt: created})
	}
	events = append(events,
		core.Event{AggregateID: uuid.NewString(), Type: "bad.one", CreatedAt: created},
		core.Event{AggregateID: uuid.NewString(), Type: "bad.two", CreatedAt: created})
	ms.Add(events...)
	pub := &failingPublisher{fail: map[string]bool{"bad.one": true, "bad.two": true}}
	r, err := core.New(ms, pub, core.Options{Observer: obs, PollInterval: 5 * time.Millisecond, BatchSize: 100})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := r.Start(ctx); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for len(ms.Pending()) > 2 || scrape(t, reg)[`outbox_events_recorded_total{result="failed"}`] < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("relay did not finish: pending %v", ms.Pending())
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := r.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}

	// The two failures are permanent: held, so published once each.
	want := map[string]float64{
		`outbox_events_published_total{broker="kafka",outcome="ok",topic="order"}`:   6,
		`outbox_events_published_total{broker="kafka",outcome="ok",topic="invoice"}`: 4,
		`outbox_events_published_total{broker="kafka",outcome="error",topic="bad"}`:  2,
		`outbox_publish_errors_total{broker="kafka",class="permanent"}`:              2,
		`outbox_publish_errors_total{broker="kafka",class="transient"}`:              0,
		`outbox_events_recorded_total{result="dispatched"}`:                          10,
		`outbox_events_recorded_total{result="failed"}`:                              2,
		`outbox_relay_errors_total{op="claim"}`:                                      0,
	}
	got := scrape(t, reg)
	for series, v := range want {
		if got[series] != v {
			t.Errorf("%s = %v, want %v", series, got[series], v)
		}
	}
	if n := got["outbox_batch_size_sum"]; n != 12 {
		t.Errorf("batch sizes sum to %v, want 12 events claimed", n)
	}
	if n := got[`outbox_commit_to_publish_seconds_count{broker="kafka"}`]; n != 10 {
		t.Errorf("commit-to-publish observations = %v, want 10 (successes only)", n)
	}
	// Every success was at least 2s after its created_at.
	if s := got[`outbox_commit_to_publish_seconds_sum{broker="kafka"}`]; s < 20 || s > 60 {
		t.Errorf("commit-to-publish sum = %vs, want 10 events of about 2s", s)
	}
	if n := got[`outbox_publish_duration_seconds_count{broker="kafka"}`]; n != 12 {
		t.Errorf("publish durations observed = %v, want 12 attempts", n)
	}
	if got["outbox_last_claim_timestamp_seconds"] < float64(created.Unix()) {
		t.Error("last claim timestamp was not set")
	}
	if problems, err := testutil.GatherAndLint(reg); err != nil || len(problems) > 0 {
		t.Errorf("lint: %v %v", problems, err)
	}
}

func TestObserverCustomTopicAndErrorClasses(t *testing.T) {
	reg := prometheus.NewRegistry()
	obs, err := metrics.NewObserver(metrics.Options{Registerer: reg, Namespace: "ob",
		Topic: func(*core.Event) string { return "all" }})
	if err != nil {
		t.Fatal(err)
	}
	e := &core.Event{Type: "x.y", CreatedAt: time.Now()}
	obs.Published(e, time.Millisecond, context.DeadlineExceeded)
	obs.Published(e, time.Millisecond, context.Canceled)
	obs.Published(e, time.Millisecond, errors.New("connection reset"))
	obs.Errored("claim", errors.New("db down"))
	got := scrape(t, reg)
	for series, v := range map[string]float64{
		`ob_publish_errors_total{broker="default",class="timeout"}`:               1,
		`ob_publish_errors_total{broker="default",class="canceled"}`:              1,
		`ob_publish_errors_total{broker="default",class="transient"}`:             1,
		`ob_events_published_total{broker="default",outcome="error",topic="all"}`: 3,
		`ob_relay_errors_total{op="claim"}`:                                       1,
	} {
		if got[series] != v {
			t.Errorf("%s = %v, want %v", series, got[series], v)
		}
	}
	if _, err := metrics.NewObserver(metrics.Options{Registerer: reg, Namespace: "ob"}); err == nil {
		t.Error("registering the same metrics twice succeeded")
	}
	if _, err := metrics.NewObserver(metrics.Options{}); err == nil {
		t.Error("nil Registerer accepted")
	}
}

func TestPollerReadsBacklog(t *testing.T) {
	pool, cfg := pgtest.Schema(t)
	st, err := table.New(pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	table := `"` + cfg.Schema + `"."events_outbox"`
	if _, err := pool.Exec(context.Background(), `INSERT INTO `+table+` (event_id, aggregate_id, type, payload, created_at, retry_at, parked_at)
VALUES (gen_random_uuid(), gen_random_uuid(), 't', '{}', now() - interval '1 hour', NULL, NULL),
       (gen_random_uuid(), gen_random_uuid(), 't', '{}', now(), 'infinity', NULL),
       (gen_random_uuid(), gen_random_uuid(), 't', '{}', now(), now() + interval '1 minute', NULL),
       (gen_random_uuid(), gen_random_uuid(), 't', '{}', now(), NULL, NULL),
       (gen_random_uuid(), gen_random_uuid(), 't', '{}', now(), NULL, now())`); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	p, err := metrics.NewPoller(st, metrics.PollerOptions{Registerer: reg, Interval: 10 * time.Millisecond, StuckAfter: 10 * time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); p.Run(ctx) }()
	deadline := time.Now().Add(5 * time.Second)
	for scrape(t, reg)["outbox_status_last_success_timestamp_seconds"] == 0 {
		if time.Now().After(deadline) {
			t.Fatal("poller never succeeded")
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	<-done
	got := scrape(t, reg)
	for series, v := range map[string]float64{
		"outbox_pending_events": 4, "outbox_held_events": 1, "outbox_retrying_events": 1,
		"outbox_parked_events": 1, "outbox_stuck_events": 2,
	} {
		if got[series] != v {
			t.Errorf("%s = %v, want %v", series, got[series], v)
		}
	}
	if age := got["outbox_oldest_pending_age_seconds"]; age < 3600 || age > 3660 {
		t.Errorf("oldest pending age = %vs, want about 3600", age)
	}
}

type brokenReader struct{}

func (brokenReader) Backlog(context.Context, time.Duration) (core.Backlog, error) {
	return core.Backlog{}, errors.New("connection refused")
}

func TestPollerCountsFailures(t *testing.T) {
	reg := prometheus.NewRegistry()
	p, err := metrics.NewPoller(brokenReader{}, metrics.PollerOptions{Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Poll(context.Background()); err == nil {
		t.Fatal("Poll hid the store's error")
	}
	got := scrape(t, reg)
	if got["outbox_status_errors_total"] != 1 || got["outbox_status_last_success_timestamp_seconds"] != 0 {
		t.Errorf("after a failed poll: %v", got)
	}
}

// scrape gathers reg into "name{labels}" -> value, with histograms as
// name_sum and name_count.
func scrape(t *testing.T, reg prometheus.Gatherer) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, l.GetName()+`="`+l.GetValue()+`"`)
			}
			suffix := ""
			if len(labels) > 0 {
				suffix = "{" + strings.Join(labels, ",") + "}"
			}
			switch {
			case m.Counter != nil:
				out[mf.GetName()+suffix] = m.GetCounter().GetValue()
			case m.Gauge != nil:
				out[mf.GetName()+suffix] = m.GetGauge().GetValue()
			case m.Histogram != nil:
				out[mf.GetName()+"_sum"+suffix] = m.GetHistogram().GetSampleSum()
				out[mf.GetName()+"_count"+suffix] = float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return out
}
