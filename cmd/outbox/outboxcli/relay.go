package outboxcli

import (
	"context"
	"fmt"
	"sync/atomic"

	"github.com/spf13/cobra"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store/table"
)

func relayCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "relay",
		Short: "Publish committed events to the broker until stopped",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			e, err := setup(cmd)
			if err != nil {
				return err
			}
			if err := e.cfg.ValidateRelay(); err != nil {
				return usagef("invalid configuration:\n%w", err)
			}
			return e.runRelay(cmd.Context())
		},
	}
	AddRelayFlags(cmd.Flags())
	return cmd
}

// RelayHooks let other parts of the binary (metrics, health) attach to a
// running relay. Each returns an observer to add (or nil) and may start
// background work that ends with ctx.
var relayHooks []func(ctx context.Context, e *app, st *table.Source, pub core.Publisher, relay func() *core.Relay) (core.Observer, error)

// publisherWraps decorate the broker's publisher (tracing) before the hooks
// and the relay see it, in order. The broker's own Close still runs once.
var publisherWraps []func(ctx context.Context, e *app, pub core.Publisher) (core.Publisher, error)

func (e *app) runRelay(ctx context.Context) error {
	// One name per process, so `outbox status` can tell replicas apart.
	// A connection per open claim stays warm: a claim that had to connect
	// first, when traffic resumed, made the latency's tail.
	pool, err := e.newPool(ctx, relayAppName+" "+relayClientName(), int32(e.cfg.Relay.Claimers)+1)
	if err != nil {
		return err
	}
	defer pool.Close()
	st, err := table.New(pool, e.cfg.StoreConfig(), e.log)
	if err != nil {
		return usageError(err)
	}
	defer e.stopped(ctx)

	// The HTTP server comes first, so /healthz answers and /readyz says
	// what the relay waits for while it waits.
	var current atomic.Pointer[core.Relay]
	var observers core.Observers
	waiting := newStartup("database", "broker")
	obs, err := e.startHTTP(ctx, st, current.Load, waiting)
	if err != nil {
		return err
	}
	if obs != nil {
		observers = append(observers, obs)
	}
	deadline := e.startupDeadline()
	if err := e.waitFor(ctx, deadline, waiting, "database", e.reachDatabase(pool)); err != nil {
		return err
	}
	var pub core.Publisher
	if err := e.waitFor(ctx, deadline, waiting, "broker", func(ctx context.Context) error {
		pub, err = brokers.Open(ctx, e.cfg.Broker, brokers.Options{
			Config: e.loader.Section(e.cfg.Broker), Topics: &e.cfg.Routing, Logger: e.log.With("broker", e.cfg.Broker),
		})
		return err // a broker section that does not decode is a usage error already
	}); err != nil {
		return err
	}
	defer pub.Close()
	for _, wrap := range publisherWraps {
		if pub, err = wrap(ctx, e, pub); err != nil {
			return err
		}
	}

	// The hooks' servers may read the relay before it is made.
	for _, hook := range relayHooks {
		obs, err := hook(ctx, e, st, pub, current.Load)
		if err != nil {
			return err
		}
		if obs != nil {
			observers = append(observers, obs)
		}
	}
	if e.cfg.Relay.Mode == "log" {
		return e.runLogRelay(ctx, st, pub, observers, current.Store)
	}
	relay, err := core.New(st, pub, e.cfg.RelayOptions(e.log, observers))
	if err != nil {
		return err
	}
	current.Store(relay)
	sc := st.Config()
	e.log.Info("relay starting", "database", Redact(e.cfg.DatabaseURL), "table", sc.Schema+"."+sc.Table,
		"broker", e.cfg.Broker, "ordered", !e.cfg.Relay.Unordered, "wakeups", e.cfg.Relay.Wakeups,
		"batch_size", e.cfg.Relay.BatchSize, "lanes", e.cfg.Relay.Lanes)
	// The table source holds the table-mode lock itself: refused while
	// log relays read this outbox's slot (and they refuse while it runs).
	if err := relay.Run(ctx); err != nil {
		return fmt.Errorf("relay: %w", err)
	}
	e.log.Info("relay stopped")
	return nil
}
