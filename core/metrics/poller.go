package metrics

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outboxhq/outbox/core"
)

// PollerOptions configure a Poller.
type PollerOptions struct {
	Registerer prometheus.Registerer // required
	Namespace  string                // default "outbox"
	Interval   time.Duration         // between queries; default 15s
	Timeout    time.Duration         // bound on one query; default 10s
	StuckAfter time.Duration         // default: the source's
	Logger     *slog.Logger          // default: discard
}

// Poller keeps the backlog gauges current by querying the source on an
// interval. Every replica that runs one exports the same values; alert on
// max() across them.
type Poller struct {
	src  core.BacklogReader
	opts PollerOptions
	log  *slog.Logger

	pending, retrying, held, parked, stuck prometheus.Gauge
	oldestAge, lastOK                      prometheus.Gauge
	failures                               prometheus.Counter
}

// NewPoller creates the gauges and registers them; Run updates them.
func NewPoller(src core.BacklogReader, opts PollerOptions) (*Poller, error) {
	switch {
	case src == nil:
		return nil, errors.New("new poller: backlog reader is nil")
	case opts.Registerer == nil:
		return nil, errors.New("new poller: Registerer is nil")
	case opts.Interval < 0, opts.Timeout < 0, opts.StuckAfter < 0:
		return nil, errors.New("new poller: Interval, Timeout and StuckAfter must not be negative")
	}
	if opts.Namespace == "" {
		opts.Namespace = "outbox"
	}
	if opts.Interval == 0 {
		opts.Interval = 15 * time.Second
	}
	if opts.Timeout == 0 {
		opts.Timeout = 10 * time.Second
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	gauge := func(name, help string) prometheus.Gauge {
		return prometheus.NewGauge(prometheus.GaugeOpts{Namespace: opts.Namespace, Name: name, Help: help})
	}
	p := &Poller{
		src: src, opts: opts, log: opts.Logger,
		pending:   gauge("pending_events", "Events neither dispatched nor parked."),
		retrying:  gauge("retrying_events", "Pending events backing off after a transient publish failure."),
		held:      gauge("held_events", "Pending events held for an operator by a permanent failure."),
		parked:    gauge("parked_events", "Events an operator set aside."),
		stuck:     gauge("stuck_events", "Pending events older than stuck.after, plus held events."),
		oldestAge: gauge("oldest_pending_age_seconds", "now() - min(created_at) over pending events; 0 when none."),
		lastOK:    gauge("status_last_success_timestamp_seconds", "Unix time of the last successful status query."),
		failures: prometheus.NewCounter(prometheus.CounterOpts{Namespace: opts.Namespace,
			Name: "status_errors_total", Help: "Failed status queries."}),
	}
	for _, c := range []prometheus.Collector{p.pending, p.retrying, p.held, p.parked, p.stuck, p.oldestAge, p.lastOK, p.failures} {
		if err := opts.Registerer.Register(c); err != nil {
			return nil, fmt.Errorf("register status metrics: %w", err)
		}
	}
	return p, nil
}

// Run polls now and then every Interval until ctx is done. A failed query
// is logged and counted; the gauges keep their last values, and
// status_last_success_timestamp_seconds shows how old they are.
func (p *Poller) Run(ctx context.Context) {
	t := time.NewTicker(p.opts.Interval)
	defer t.Stop()
	for {
		if err := p.Poll(ctx); err != nil && ctx.Err() == nil {
			p.log.Warn("outbox status query failed", "error", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Poll queries the source once and updates the gauges.
func (p *Poller) Poll(ctx context.Context) error {
	qctx, cancel := context.WithTimeout(ctx, p.opts.Timeout)
	defer cancel()
	s, err := p.src.Backlog(qctx, p.opts.StuckAfter)
	if err != nil {
		p.failures.Inc()
		return fmt.Errorf("poll outbox status: %w", err)
	}
	p.pending.Set(float64(s.Pending))
	p.retrying.Set(float64(s.Retrying))
	p.held.Set(float64(s.Held))
	p.parked.Set(float64(s.Parked))
	p.stuck.Set(float64(s.Stuck))
	p.oldestAge.Set(s.OldestPendingAge.Seconds())
	p.lastOK.SetToCurrentTime()
	return nil
}
