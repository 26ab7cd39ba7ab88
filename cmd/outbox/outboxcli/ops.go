package outboxcli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/outboxhq/outbox/store/admin"
	"github.com/outboxhq/outbox/store/table"
)

// Operator commands over the whole outbox: status, replay and cleanup.
// Each prints for people by default and JSON with --json; progress of long
// runs goes to stderr, so stdout stays parseable.

func init() {
	extraCommands = append(extraCommands, statusCmd, replayCmd, cleanupCmd)
}

// relayAppName is the application_name relays connect with (runRelay).
const relayAppName = "outbox-relay"

// withStore sets up the command's configuration and store and runs fn.
func withStore(cmd *cobra.Command, appName string, fn func(ctx context.Context, e *app, st *table.Source) error) error {
	e, err := setup(cmd)
	if err != nil {
		return err
	}
	ctx := cmd.Context()
	st, err := e.openStore(ctx, appName)
	if err != nil {
		return err
	}
	defer st.Pool().Close()
	return fn(ctx, e, st)
}

// withAdmin sets up the command's configuration and the outbox's operator
// queries and runs fn.
func withAdmin(cmd *cobra.Command, appName string, fn func(ctx context.Context, e *app, st *admin.Admin) error) error {
	return withStore(cmd, appName, func(ctx context.Context, e *app, st *table.Source) error {
		ad, err := admin.New(st.Pool(), st.Config(), e.log)
		if err != nil {
			return err
		}
		return fn(ctx, e, ad)
	})
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// seconds renders a duration for JSON as a number of seconds.
func seconds(d time.Duration) float64 { return d.Seconds() }

// human rounds a duration for people.
func human(d time.Duration) string {
	switch {
	case d == 0:
		return "0s"
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < time.Hour:
		return d.Round(time.Second).String()
	default:
		return d.Round(time.Minute).String()
	}
}

type statusJSON struct {
	Pending              int64         `json:"pending"`
	OldestPendingSeconds float64       `json:"oldest_pending_age_seconds"`
	OldestPending        *time.Time    `json:"oldest_pending_created_at,omitempty"`
	DispatchedLastMinute int64         `json:"dispatched_last_minute"`
	Stuck                int64         `json:"stuck"`
	StuckAfterSeconds    float64       `json:"stuck_after_seconds"`
	Retrying             int64         `json:"retrying"`
	Held                 int64         `json:"held"`
	Scheduled            int64         `json:"scheduled"`
	Parked               int64         `json:"parked"`
	Replicas             []replicaJSON `json:"relay_sessions"`
	At                   time.Time     `json:"at"`
}

type replicaJSON struct {
	Client             string  `json:"client"`
	Connections        int     `json:"connections"`
	InClaim            int     `json:"in_claim"`
	OldestClaimSeconds float64 `json:"oldest_claim_seconds"`
}

func statusCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show the backlog: pending events, oldest age, publish rate, stuck events, relay sessions",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return withAdmin(cmd, "outbox-status", func(ctx context.Context, e *app, st *admin.Admin) error {
				s, err := st.Status(ctx, admin.StatusOptions{StuckAfter: e.cfg.Stuck.After, RelayApplication: relayAppName})
				if err != nil {
					return err
				}
				out := statusJSON{Pending: s.Pending, OldestPendingSeconds: seconds(s.OldestPendingAge),
					DispatchedLastMinute: s.DispatchedLastMinute, Stuck: s.Stuck, StuckAfterSeconds: seconds(e.cfg.Stuck.After),
					Retrying: s.Retrying, Held: s.Held, Scheduled: s.Scheduled, Parked: s.Parked, Replicas: []replicaJSON{}, At: s.Now}
				if !s.OldestPending.IsZero() {
					out.OldestPending = &s.OldestPending
				}
				for _, r := range s.Replicas {
					rj := replicaJSON{Client: r.Client, Connections: r.Connections, InClaim: r.InClaim}
					if !r.OldestClaim.IsZero() {
						rj.OldestClaimSeconds = seconds(s.Now.Sub(r.OldestClaim))
					}
					out.Replicas = append(out.Replicas, rj)
				}
				if asJSON {
					return writeJSON(e.out, out)
				}
				return printStatus(e.out, out, e.cfg.Stuck.After)
			})
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func printStatus(w io.Writer, s statusJSON, stuckAfter time.Duration) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "pending\t%d\n", s.Pending)
	oldest := "-"
	if s.OldestPending != nil {
		oldest = fmt.Sprintf("%s (due %s)", human(time.Duration(s.OldestPendingSeconds*float64(time.Second))),
			s.OldestPending.UTC().Format(time.RFC3339))
	}
	fmt.Fprintf(tw, "oldest pending\t%s\n", oldest)
	fmt.Fprintf(tw, "publish rate\t%d/min (%.1f/s over the last minute)\n", s.DispatchedLastMinute, float64(s.DispatchedLastMinute)/60)
	fmt.Fprintf(tw, "stuck\t%d (due and pending over %s, or held)\n", s.Stuck, human(stuckAfter))
	fmt.Fprintf(tw, "retrying\t%d\n", s.Retrying)
	fmt.Fprintf(tw, "held\t%d (failed permanently: see `outbox stuck`)\n", s.Held)
	fmt.Fprintf(tw, "scheduled\t%d (waiting for their deliver-at time; not stuck)\n", s.Scheduled)
	fmt.Fprintf(tw, "parked\t%d\n", s.Parked)
	if len(s.Replicas) == 0 {
		fmt.Fprintf(tw, "relay sessions\tnone connected\n")
	}
	for i, r := range s.Replicas {
		label := ""
		if i == 0 {
			label = "relay sessions"
		}
		claim := ""
		if r.InClaim > 0 {
			claim = fmt.Sprintf(", oldest open %s", human(time.Duration(r.OldestClaimSeconds*float64(time.Second))))
		}
		fmt.Fprintf(tw, "%s\t%s: %d connections, %d in a claim%s\n", label, r.Client, r.Connections, r.InClaim, claim)
	}
	return tw.Flush()
}

// parseWhen reads a time as RFC 3339 or as a duration ago ("36h").
func parseWhen(flag, v string) (time.Time, error) {
	if v == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339, v); err == nil {
		return t, nil
	}
	if d, err := time.ParseDuration(v); err == nil && d > 0 {
		return time.Now().Add(-d), nil
	}
	return time.Time{}, usagef("--%s: %q is neither an RFC 3339 time nor a duration ago such as 36h", flag, v)
}

type replayJSON struct {
	Selector string `json:"selector"`
	Replayed int64  `json:"replayed"`
	DryRun   bool   `json:"dry_run"`
}

func replayCmd() *cobra.Command {
	var (
		sel        admin.Selector
		parseTimes func() error
		batch      int
		dryRun     bool
		asJSON     bool
	)
	cmd := &cobra.Command{
		Use:   "replay",
		Short: "Publish dispatched events again, with their original identity",
		Long: "replay makes the selected dispatched events pending again; the relay publishes them with the\n" +
			"same event_id, so consumers that already processed them drop them as duplicates. Pending and\n" +
			"parked events are not touched. Criteria combine with AND; at least one is required.",
		Example: "  outbox replay --type order.placed --created-after 2026-01-02T00:00:00Z --created-before 2026-01-03T00:00:00Z\n" +
			"  outbox replay --from-seq 1200 --to-seq 1300 --dry-run\n" +
			"  outbox replay --aggregate 0b9c6f0e-4a57-4a4e-9d0e-1b5b3c7f6a10 --created-after 36h",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := parseTimes(); err != nil {
				return usageError(err)
			}
			if err := sel.Validate(); err != nil {
				return usageError(err)
			}
			if batch < 1 || batch > 100000 {
				return usagef("--batch: %d is not between 1 and 100000", batch)
			}
			return withAdmin(cmd, "outbox-replay", func(ctx context.Context, e *app, st *admin.Admin) error {
				progress := func(n int64) {
					fmt.Fprintf(cmd.ErrOrStderr(), "replay: %d events so far\n", n)
				}
				n, err := st.Replay(ctx, sel, admin.ReplayOptions{BatchSize: batch, DryRun: dryRun, Progress: progress})
				if err != nil {
					if n > 0 {
						return fmt.Errorf("%w (%d events were replayed before the error)", err, n)
					}
					return err
				}
				if asJSON {
					if err := writeJSON(e.out, replayJSON{Selector: sel.String(), Replayed: n, DryRun: dryRun}); err != nil {
						return err
					}
					return noMatch(n)
				}
				verb := "replayed"
				if dryRun {
					verb = "would replay"
				}
				fmt.Fprintf(e.out, "%s %s (%s)\n", verb, events(n), sel)
				return noMatch(n)
			})
		},
	}
	parseTimes = selectorFlags(cmd, &sel)
	f := cmd.Flags()
	f.IntVar(&batch, "batch", 1000, "events per transaction")
	f.BoolVar(&dryRun, "dry-run", false, "count the events, change nothing")
	f.BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

type cleanupJSON struct {
	DryRun                   bool      `json:"dry_run"`
	OutboxDeleted            int64     `json:"outbox_deleted"`
	ProcessedDeleted         int64     `json:"processed_deleted"`
	OutboxCutoff             time.Time `json:"outbox_cutoff"`
	ProcessedCutoff          time.Time `json:"processed_cutoff"`
	Batches                  int       `json:"batches"`
	ElapsedSeconds           float64   `json:"elapsed_seconds"`
	DispatchedWindowSeconds  float64   `json:"dispatched_window_seconds"`
	ProcessedWindowSeconds   float64   `json:"processed_window_seconds"`
	AnotherCleanupWasRunning bool      `json:"another_cleanup_running,omitempty"`
}

func cleanupCmd() *cobra.Command {
	var (
		dispatched, processed time.Duration
		batch                 int
		dryRun, asJSON        bool
	)
	cmd := &cobra.Command{
		Use:   "cleanup",
		Short: "Delete dispatched events and dedupe records older than their retention windows",
		Long: "cleanup deletes dispatched events older than --dispatched (retention.dispatched, 7 days by\n" +
			"default) and processed_events rows older than --processed (retention.processed), in batches of\n" +
			"short transactions. Pending and parked events are never deleted. One cleanup runs at a time per\n" +
			"outbox, this command or a relay's scheduled one.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return withAdmin(cmd, "outbox-cleanup", func(ctx context.Context, e *app, st *admin.Admin) error {
				rt := e.cfg.Retention
				if !cmd.Flags().Changed("dispatched") {
					dispatched = rt.Dispatched
				}
				if !cmd.Flags().Changed("processed") {
					processed = rt.Processed
				}
				if !cmd.Flags().Changed("batch") {
					batch = rt.BatchSize
				}
				switch {
				case dispatched <= 0:
					return usagef("--dispatched: must be a positive duration such as 168h")
				case processed <= 0:
					return usagef("--processed: must be a positive duration such as 336h")
				case batch < 1 || batch > 100000:
					return usagef("--batch: %d is not between 1 and 100000", batch)
				}
				opts := admin.CleanupOptions{Dispatched: dispatched, Processed: processed, BatchSize: batch, DryRun: dryRun,
					Progress: func(p admin.CleanupProgress) {
						fmt.Fprintf(cmd.ErrOrStderr(), "cleanup: %s: %d rows deleted so far\n", p.Table, p.Deleted)
					}}
				res, err := st.Cleanup(ctx, opts)
				out := cleanupJSON{DryRun: dryRun, OutboxDeleted: res.Outbox, ProcessedDeleted: res.Processed,
					OutboxCutoff: res.OutboxCutoff, ProcessedCutoff: res.ProcessedCutoff, Batches: res.Batches,
					ElapsedSeconds: seconds(res.Elapsed), DispatchedWindowSeconds: seconds(dispatched),
					ProcessedWindowSeconds: seconds(processed)}
				if errors.Is(err, admin.ErrCleanupBusy) && asJSON {
					out.AnotherCleanupWasRunning = true
					_ = writeJSON(e.out, out)
				}
				if err != nil {
					return err
				}
				if asJSON {
					return writeJSON(e.out, out)
				}
				verb := "deleted"
				if dryRun {
					verb = "would delete"
				}
				fmt.Fprintf(e.out, "%s %d dispatched events older than %s (before %s)\n", verb, res.Outbox,
					human(dispatched), res.OutboxCutoff.UTC().Format(time.RFC3339))
				fmt.Fprintf(e.out, "%s %d processed_events rows older than %s (before %s)\n", verb, res.Processed,
					human(processed), res.ProcessedCutoff.UTC().Format(time.RFC3339))
				if !dryRun {
					fmt.Fprintf(e.out, "%d batches in %s\n", res.Batches, human(res.Elapsed))
				}
				return nil
			})
		},
	}
	f := cmd.Flags()
	f.DurationVar(&dispatched, "dispatched", 0, "keep dispatched events this long (default retention.dispatched, 168h)")
	f.DurationVar(&processed, "processed", 0, "keep processed_events rows this long (default retention.processed, 336h)")
	f.IntVar(&batch, "batch", 0, "rows per delete (default retention.batch_size, 5000)")
	f.BoolVar(&dryRun, "dry-run", false, "count what would be deleted, delete nothing")
	f.BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

// events is "1 event" or "n events".
func events(n int64) string {
	if n == 1 {
		return "1 event"
	}
	return strconv.FormatInt(n, 10) + " events"
}
