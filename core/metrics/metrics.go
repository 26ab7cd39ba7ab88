// Package metrics exports the relay's measurements to Prometheus: an
// Observer the relay calls on its hot path (counters and histograms only),
// and a Poller that reads the outbox's backlog gauges from the database on
// an interval, never per event.
//
// Both register on a caller-supplied prometheus.Registerer; nothing touches
// the global registry. Labels are bounded: broker, topic (resolved by the
// caller's function, by default the event type up to its first dot), outcome
// and error class. The aggregate id never becomes a label.
package metrics

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outboxhq/outbox/core"
)

// Options configure an Observer.
type Options struct {
	Registerer prometheus.Registerer // required
	Namespace  string                // metric name prefix; default "outbox"
	Broker     string                // value of the broker label; default "default"
	// Topic maps an event to its topic label. It must return few distinct
	// values (a topic, never an id). Default: the event type up to its
	// first dot, as "order.placed" gives "order".
	Topic func(*core.Event) string
}

func (o Options) withDefaults() (Options, error) {
	if o.Registerer == nil {
		return o, errors.New("metrics options: Registerer is nil")
	}
	if o.Namespace == "" {
		o.Namespace = "outbox"
	}
	if o.Broker == "" {
		o.Broker = "default"
	}
	if o.Topic == nil {
		o.Topic = TypePrefix
	}
	return o, nil
}

// TypePrefix is the default topic label: the event type up to its first
// dot, or the whole type when it has none.
func TypePrefix(e *core.Event) string {
	head, _, _ := strings.Cut(e.Type, ".")
	return head
}

// Observer implements core.Observer with Prometheus metrics.
type Observer struct {
	broker   string
	topic    func(*core.Event) string
	events   *prometheus.CounterVec
	errs     *prometheus.CounterVec
	relay    *prometheus.CounterVec
	recorded *prometheus.CounterVec
	batch    prometheus.Histogram
	claim    prometheus.Histogram
	publish  prometheus.Histogram
	complete prometheus.Histogram
	latency  prometheus.Histogram
	lastPoll prometheus.Gauge
}

var _ core.Observer = (*Observer)(nil)

// NewObserver creates the relay metrics and registers them.
func NewObserver(opts Options) (*Observer, error) {
	o, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	ns := o.Namespace
	broker := prometheus.Labels{"broker": o.Broker}
	obs := &Observer{
		broker: o.Broker,
		topic:  o.Topic,
		events: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "events_published_total",
			Help: "Publish attempts by broker, topic and outcome: ok, error, or rejected (a row held because it cannot be relayed)."}, []string{"broker", "topic", "outcome"}),
		errs: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "publish_errors_total",
			Help: "Failed publish attempts by broker and class: transient, permanent, timeout or canceled."}, []string{"broker", "class"}),
		relay: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "relay_errors_total",
			Help: "Relay-level failures by operation: claim, complete or release."}, []string{"op"}),
		recorded: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "events_recorded_total",
			Help: "Publish outcomes committed to the outbox: dispatched, or failed (retried or held)."}, []string{"result"}),
		batch: prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: ns, Name: "batch_size",
			Help:    "Events per non-empty claim.",
			Buckets: []float64{1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000}}),
		claim: prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: ns, Name: "claim_duration_seconds",
			Help: "Time to claim a batch, empty claims included.", Buckets: durationBuckets}),
		publish: prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: ns, Name: "publish_duration_seconds",
			Help: "Time of one publish attempt.", Buckets: durationBuckets, ConstLabels: broker}),
		complete: prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: ns, Name: "complete_duration_seconds",
			Help: "Time to record a batch's outcome and commit its claim.", Buckets: durationBuckets}),
		latency: prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: ns, Name: "commit_to_publish_seconds",
			Help:        "From the event's created_at (the producer's transaction start) to its successful publish.",
			Buckets:     []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600},
			ConstLabels: broker}),
		lastPoll: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "last_claim_timestamp_seconds",
			Help: "Unix time of the relay's last successful claim; a stalled relay stops moving it."}),
	}
	for _, c := range []prometheus.Collector{obs.events, obs.errs, obs.relay, obs.recorded, obs.batch,
		obs.claim, obs.publish, obs.complete, obs.latency, obs.lastPoll} {
		if err := o.Registerer.Register(c); err != nil {
			return nil, fmt.Errorf("register relay metrics: %w", err)
		}
	}
	// Zero series up front, so rate() and alerts see a 0 rather than
	// nothing before the first failure.
	for _, class := range []string{classTransient, classPermanent, classTimeout, classCanceled} {
		obs.errs.WithLabelValues(o.Broker, class)
	}
	for _, op := range []string{"claim", "complete", "release"} {
		obs.relay.WithLabelValues(op)
	}
	obs.recorded.WithLabelValues("dispatched")
	obs.recorded.WithLabelValues("failed")
	return obs, nil
}

// durationBuckets span a fast local claim to a slow broker.
var durationBuckets = []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30}

const (
	classTransient = "transient"
	classPermanent = "permanent"
	classTimeout   = "timeout"
	classCanceled  = "canceled"
)

// Class names the kind of a publish error for the class label.
func Class(err error) string {
	switch {
	case core.IsPermanent(err):
		return classPermanent
	case errors.Is(err, context.DeadlineExceeded):
		return classTimeout
	case errors.Is(err, context.Canceled):
		return classCanceled
	default:
		return classTransient
	}
}

// Claimed implements core.Observer.
func (o *Observer) Claimed(n int, d time.Duration) {
	o.claim.Observe(d.Seconds())
	o.lastPoll.SetToCurrentTime()
	if n > 0 {
		o.batch.Observe(float64(n))
	}
}

// Published implements core.Observer.
func (o *Observer) Published(e *core.Event, d time.Duration, err error) {
	o.publish.Observe(d.Seconds())
	topic := o.topic(e)
	if err != nil {
		o.events.WithLabelValues(o.broker, topic, "error").Inc()
		o.errs.WithLabelValues(o.broker, Class(err)).Inc()
		return
	}
	o.events.WithLabelValues(o.broker, topic, "ok").Inc()
	o.latency.Observe(max(time.Since(e.CreatedAt), 0).Seconds())
}

// Completed implements core.Observer.
func (o *Observer) Completed(done, failed int, d time.Duration) {
	o.complete.Observe(d.Seconds())
	o.recorded.WithLabelValues("dispatched").Add(float64(done))
	o.recorded.WithLabelValues("failed").Add(float64(failed))
}

// Rejected implements core.Observer: the row counts as an event with
// result "rejected".
func (o *Observer) Rejected(e *core.Event, _ error) {
	o.events.WithLabelValues(o.broker, o.topic(e), "rejected").Inc()
}

// Errored implements core.Observer.
func (o *Observer) Errored(op string, _ error) {
	o.relay.WithLabelValues(op).Inc()
}
