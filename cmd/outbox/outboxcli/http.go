package outboxcli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/cmd/outbox/console"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/metrics"
	"github.com/outboxhq/outbox/store/admin"
	"github.com/outboxhq/outbox/store/table"
)

func init() { relayHooks = append(relayHooks, startPoller) }

// startHTTP serves /metrics, /healthz and /readyz when http.listen is set,
// and returns the metrics observer for the relay. Until relay returns one,
// /readyz shows the checks of waiting: what the starting relay waits for.
func (e *app) startHTTP(ctx context.Context, st *table.Source, relay func() *core.Relay, waiting *startup) (core.Observer, error) {
	addr := e.cfg.HTTP.Listen
	if addr == "" {
		return nil, nil
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	routing := &e.cfg.Routing
	obs, err := metrics.NewObserver(metrics.Options{Registerer: reg, Broker: e.cfg.Broker, Topic: topicLabel(routing)})
	if err != nil {
		return nil, err
	}
	if e.cfg.Relay.Mode == "log" {
		e.slots = newSlotMetrics(reg)
	} else if !e.cfg.Relay.Unordered {
		registerPartitions(reg, st)
	}
	poller, err := metrics.NewPoller(st, metrics.PollerOptions{Registerer: reg, StuckAfter: e.cfg.Stuck.After, Logger: e.log})
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("http.listen %s: %w", addr, err)
	}
	ready := func(ctx context.Context) []core.Check {
		var checks []core.Check
		if r := relay(); r != nil {
			checks = r.Ready(ctx)
			if log := e.logReady.Load(); log != nil {
				checks = append(checks, (*log)()...)
			}
		} else {
			checks = append(waiting.checks(), core.Check{Name: "progress", Err: errors.New("relay not started")})
		}
		// /readyz shows the failures, which may quote a connection setting.
		for i := range checks {
			checks[i].Err = e.mask.error(checks[i].Err)
		}
		return checks
	}
	mux := opsHandler(reg, ready, e.log)
	paths := "/metrics /healthz /readyz"
	if e.cfg.Console.Enabled {
		name := relayClientName()
		con, err := e.newConsole(st, func() (string, time.Time) {
			if r := relay(); r != nil {
				return name, r.LastProgress()
			}
			return name, time.Time{}
		})
		if err != nil {
			_ = ln.Close()
			return nil, err
		}
		mountConsole(mux, con)
		paths += " /console/ /api/v1/"
	}
	e.poller = poller
	serveHTTP(ctx, e, ln, mux)
	e.log.Info("http listening", "addr", ln.Addr().String(), "paths", paths)
	return obs, nil
}

// startPoller runs the backlog gauges' queries once the database is
// reached, when /metrics is served.
func startPoller(ctx context.Context, e *app, _ *table.Source, _ core.Publisher, _ func() *core.Relay) (core.Observer, error) {
	if e.poller != nil {
		go e.poller.Run(ctx)
	}
	return nil, nil
}

// serveHTTP serves h on ln until ctx is done, then shuts the server down,
// giving requests in flight a few seconds.
func serveHTTP(ctx context.Context, e *app, ln net.Listener, h http.Handler) (done <-chan struct{}) {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 30 * time.Second,
		WriteTimeout: time.Minute, IdleTimeout: 2 * time.Minute}
	stopped := make(chan struct{})
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			e.log.Error("http listener stopped", "error", err)
		}
	}()
	go func() {
		defer close(stopped)
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	return stopped
}

// relayClientName is how `outbox status` and the console name this
// process among the relays: the suffix of its application_name.
func relayClientName() string {
	host, _ := os.Hostname()
	return fmt.Sprintf("%s:%d", host, os.Getpid())
}

// newConsole builds the console of the configuration over st.
func (e *app) newConsole(st *table.Source, local func() (string, time.Time)) (*console.Console, error) {
	c := e.cfg.Console
	ad, err := admin.New(st.Pool(), st.Config(), e.log)
	if err != nil {
		return nil, err
	}
	con, err := console.New(console.Options{
		Admin: ad, Logger: e.log.With("component", "console"),
		Token: c.Token, Username: c.Username, Password: c.Password,
		AnonymousReads: c.AnonymousReads, ReadOnly: c.ReadOnly,
		StuckAfter: e.cfg.Stuck.After, LagSLO: c.LagSLO, RelayApplication: relayAppName, LocalRelay: local,
	})
	if err != nil {
		return nil, usageError(err)
	}
	return con, nil
}

// mountConsole adds the console's paths to mux, with / leading to it.
func mountConsole(mux *http.ServeMux, con *console.Console) {
	for _, p := range console.Paths {
		mux.Handle(p, con)
	}
	mux.Handle("/console", con)
	mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, "/console/", http.StatusFound)
	})
}

// topicLabel resolves the topic label through the routing rules, whose
// topics are a bounded set of configured names.
func topicLabel(r *brokers.Routing) func(*core.Event) string {
	return func(e *core.Event) string {
		t, err := r.Topic(e)
		if err != nil {
			return "unrouted"
		}
		return t
	}
}

// opsHandler serves the metrics of reg and the health endpoints: /healthz
// answers while the process runs; /readyz runs the relay's readiness
// checks (core.Relay.Ready), bounded, and answers 503 naming the failures.
func opsHandler(reg prometheus.Gatherer, ready func(context.Context) []core.Check, log *slog.Logger) *http.ServeMux {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	healthHandlers(mux, ready, log)
	return mux
}

// healthHandlers adds /healthz and /readyz to mux.
func healthHandlers(mux *http.ServeMux, ready func(context.Context) []core.Check, log *slog.Logger) {
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 3*time.Second)
		defer cancel()
		results := map[string]string{}
		status := http.StatusOK
		for _, c := range ready(ctx) {
			results[c.Name] = "ok"
			if c.Err != nil {
				results[c.Name] = c.Err.Error()
				status = http.StatusServiceUnavailable
				log.Warn("not ready", "check", c.Name, "reason", c.Err)
			}
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_ = json.NewEncoder(w).Encode(map[string]any{"ready": status == http.StatusOK, "checks": results})
	})
}

// registerPartitions exports how many partitions of aggregates an ordered
// relay claims from: its share while it shares them with other replicas,
// all of them while it does not.
func registerPartitions(reg prometheus.Registerer, st *table.Source) {
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: "outbox", Name: "partitions_owned",
		Help: "Partitions of aggregates this ordered relay claims from, of " + strconv.Itoa(table.Partitions) + ".",
	}, func() float64 {
		if p := st.Owned(); p != nil {
			return float64(len(p))
		}
		return table.Partitions
	}))
}
