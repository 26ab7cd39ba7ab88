package outboxcli

import (
	"context"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/cobra"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store/logrelay"
	"github.com/outboxhq/outbox/store/table"
)

// relay.mode log runs a logrelay.Pair: the log relay reads the slot; beside
// it, a table relay over the handoff view publishes the events handed to
// the table (poison events and those behind them, rows committed before
// the slot existed).

func init() { extraCommands = append(extraCommands, slotCmd) }

// runLogRelay runs the pair until ctx ends. setRelay hands the table
// path's relay to the hooks (readiness, the console's progress).
func (e *app) runLogRelay(ctx context.Context, st *table.Source, pub core.Publisher, obs core.Observer, setRelay func(*core.Relay)) error {
	pool := st.Pool()
	lo := e.cfg.LogRelayOptions(e.log.With("path", "log"), obs)
	lo.ApplicationName = fmt.Sprintf("%s log", relayAppName)
	// The default slot name depends on the database: resolved here, so
	// the log line and the slot metrics name the slot the relay reads.
	var err error
	if lo.Slot, err = lo.Slot.Resolve(ctx, pool, st.Config()); err != nil {
		return err
	}
	tableOpts := e.cfg.RelayOptions(e.log.With("path", "table"), obs)
	handoff, err := table.NewHandOff(pool, lo.Store, tableOpts.Logger)
	if err != nil {
		return usageError(err)
	}
	pair, err := logrelay.NewPair(pool, pub, lo, handoff, tableOpts)
	if err != nil {
		return usageError(err)
	}
	setRelay(pair.Table)
	if e.slots != nil {
		go e.slots.run(ctx, pool, pair.Log.Options(), pair.Log, e)
	}
	ready := pair.LogReady
	e.logReady.Store(&ready)
	lo = pair.Log.Options()
	e.log.Info("relay starting", "mode", "log", "database", Redact(e.cfg.DatabaseURL), "table", lo.Store.Schema+"."+lo.Store.Table,
		"slot", lo.Slot.Name, "publication", lo.Slot.Publication, "broker", e.cfg.Broker, "lanes", lo.Lanes,
		"max_in_flight", lo.MaxInFlight, "wal_sender_timeout", lo.WALSenderTimeout)
	if err := pair.Run(ctx); err != nil {
		return err
	}
	e.log.Info("relay stopped")
	return nil
}

// slotMetrics are the slot's gauges on /metrics, read from
// pg_replication_slots on an interval (never per event).
type slotMetrics struct {
	lag, retained, safe, active, holding, inFlight, lost prometheus.Gauge
}

func newSlotMetrics(reg prometheus.Registerer) *slotMetrics {
	g := func(name, help string) prometheus.Gauge {
		x := prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "outbox", Subsystem: "slot", Name: name, Help: help})
		reg.MustRegister(x)
		return x
	}
	return &slotMetrics{
		lag:      g("lag_bytes", "WAL between the server's position and the slot's confirmed position."),
		retained: g("retained_wal_bytes", "WAL the server keeps for the slot (from its restart position)."),
		safe:     g("safe_wal_bytes", "WAL that can still be written before the slot is lost (max_slot_wal_keep_size); -1 when unlimited."),
		active:   g("active", "1 when a relay reads the slot."),
		holding:  g("held_by_this_relay", "1 when this relay process reads the slot."),
		inFlight: g("in_flight_events", "Events this relay read from the slot and has not yet published and recorded."),
		lost:     g("invalidated", "1 when the server invalidated the slot (wal_status lost): no relay can read it again."),
	}
}

func (m *slotMetrics) run(ctx context.Context, pool *pgxpool.Pool, o logrelay.Options, r *logrelay.Relay, e *app) {
	t := time.NewTicker(10 * time.Second)
	defer t.Stop()
	for {
		m.holding.Set(b2f(r.Holding()))
		m.inFlight.Set(float64(r.InFlight()))
		qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		st, err := logrelay.Inspect(qctx, pool, o.Store, o.Slot)
		cancel()
		if err == nil && st.Exists {
			m.lag.Set(float64(st.LagBytes))
			m.retained.Set(float64(st.RetainedBytes))
			m.safe.Set(float64(st.SafeWALBytes))
			m.active.Set(b2f(st.Active))
			m.lost.Set(b2f(st.WALStatus == "lost"))
		} else if err != nil && ctx.Err() == nil {
			e.log.Warn("read slot gauges", "error", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

func slotCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "slot",
		Short: "Create, inspect or drop the log relay's replication slot and publication",
		Long: "slot manages what relay.mode log reads: a logical replication slot (pgoutput) and a\n" +
			"publication of the outbox table's inserts. Names come from relay.log.slot and\n" +
			"relay.log.publication (default outbox_<database>_<schema>_<table>). The role needs REPLICATION, and\n" +
			"ownership of the table to create the publication.",
	}
	cmd.AddCommand(
		&cobra.Command{
			Use:   "create",
			Short: "Create the publication and the slot, each unless it exists",
			Long: "create makes the publication and the slot. Pending rows committed before the slot existed\n" +
				"are not in its stream: they are handed to the table path, which publishes them in order, so\n" +
				"switching an outbox from relay.mode table to log loses nothing (stop the table relays first).",
			Args: cobra.NoArgs,
			RunE: func(cmd *cobra.Command, _ []string) error {
				return withStore(cmd, "outbox-slot", func(ctx context.Context, e *app, st *table.Source) error {
					o := e.cfg.LogRelayOptions(nil, nil)
					c, err := logrelay.CreateSlot(ctx, st.Pool(), st.Config(), o.Slot)
					if err != nil {
						return err
					}
					s, err := o.Slot.Resolve(ctx, st.Pool(), st.Config())
					if err != nil {
						return err
					}
					fmt.Fprintf(cmd.OutOrStdout(), "slot %s: %s\npublication %s: %s\nrows handed to the table path: %d\n",
						s.Name, createdWord(c.Slot), s.Publication, createdWord(c.Publication), c.HandedOff)
					if after, err := logrelay.Inspect(ctx, st.Pool(), st.Config(), s); err == nil && c.Slot {
						fmt.Fprintf(cmd.OutOrStdout(), "the slot relays log-only events committed after %s\n", after.ConfirmedFlush)
					}
					return nil
				})
			},
		},
		&cobra.Command{
			Use:   "status",
			Short: "Show the slot's position, lag, retained WAL and publication",
			Args:  cobra.NoArgs,
			RunE: func(cmd *cobra.Command, _ []string) error {
				return withStore(cmd, "outbox-slot", func(ctx context.Context, e *app, st *table.Source) error {
					o := e.cfg.LogRelayOptions(nil, nil)
					s, err := logrelay.Inspect(ctx, st.Pool(), st.Config(), o.Slot)
					if err != nil {
						return err
					}
					if asJSON, _ := cmd.Flags().GetBool("json"); asJSON {
						return writeJSON(cmd.OutOrStdout(), s)
					}
					w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
					fmt.Fprintf(w, "slot\t%s\n", s.Slot)
					if !s.Exists {
						fmt.Fprintf(w, "exists\tno (create it with `outbox slot create`)\n")
					} else {
						fmt.Fprintf(w, "plugin\t%s\nactive\t%v (pid %d)\nconfirmed\t%s\nrestart\t%s\nlag\t%d bytes\nretained WAL\t%d bytes\nwal_status\t%s\n",
							s.Plugin, s.Active, s.ActivePID, s.ConfirmedFlush, s.RestartLSN, s.LagBytes, s.RetainedBytes, s.WALStatus)
						if s.SafeWALBytes >= 0 {
							fmt.Fprintf(w, "safe WAL left\t%d bytes\n", s.SafeWALBytes)
						} else {
							fmt.Fprintf(w, "safe WAL left\tunlimited (max_slot_wal_keep_size = -1)\n")
						}
						if s.InvalidationReason != "" {
							fmt.Fprintf(w, "invalidated\t%s\n", s.InvalidationReason)
						}
						switch {
						case !s.FailoverCapable:
							fmt.Fprintf(w, "failover\tno (PostgreSQL 17 and later synchronize failover slots to standbys)\n")
						case s.Failover:
							fmt.Fprintf(w, "failover\tyes\n")
						default:
							fmt.Fprintf(w, "failover\tno (a relay makes it one when it starts reading the slot)\n")
						}
					}
					fmt.Fprintf(w, "publication\t%s (exists %v, tables %s)\n", s.Publication, s.PublicationExists, strings.Join(s.PublicationTables, ", "))
					return w.Flush()
				})
			},
		},
		&cobra.Command{
			Use:   "drop",
			Short: "Drop the slot and the publication (stop the log relays first)",
			Long: "drop removes the slot and the publication. The slot's position is lost: log-only events\n" +
				"committed since the last confirmed one are not relayed by a slot created later (pending rows\n" +
				"of the table are: create hands them to the table path). An active slot is refused.",
			Args: cobra.NoArgs,
			RunE: func(cmd *cobra.Command, _ []string) error {
				return withStore(cmd, "outbox-slot", func(ctx context.Context, e *app, st *table.Source) error {
					o := e.cfg.LogRelayOptions(nil, nil)
					before, err := logrelay.Inspect(ctx, st.Pool(), st.Config(), o.Slot)
					if err != nil {
						return err
					}
					if err := logrelay.DropSlot(ctx, st.Pool(), st.Config(), o.Slot); err != nil {
						return err
					}
					fmt.Fprintln(cmd.OutOrStdout(), "slot and publication dropped")
					if before.Exists {
						fmt.Fprintf(cmd.OutOrStdout(), "log-only events committed after %s, the slot's last confirmed position, and before the next `outbox slot create` are not relayed\n",
							before.ConfirmedFlush)
					}
					return nil
				})
			},
		},
	)
	// By name: cobra sorts the subcommands, so an index names another one.
	for _, c := range cmd.Commands() {
		if c.Name() == "status" {
			c.Flags().Bool("json", false, "print JSON")
		}
	}
	return cmd
}

func createdWord(created bool) string {
	if created {
		return "created"
	}
	return "exists"
}
