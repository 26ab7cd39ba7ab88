package outboxcli

import (
	"context"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/outboxhq/outbox/store/admin"
)

// Commands for events that do not go out: stuck, retry, park, unpark.

func init() {
	extraCommands = append(extraCommands, stuckCmd, retryCmd, parkCmd, unparkCmd)
}

type stuckJSON struct {
	Seq          int64      `json:"seq"`
	ID           string     `json:"event_id"`
	AggregateID  string     `json:"aggregate_id"`
	Type         string     `json:"type"`
	CreatedAt    time.Time  `json:"created_at"`
	AgeSeconds   float64    `json:"age_seconds"`
	Attempts     int        `json:"attempts"`
	LastError    string     `json:"last_error,omitempty"`
	RetryAt      *time.Time `json:"retry_at,omitempty"`
	Held         bool       `json:"held"`
	ParkedAt     *time.Time `json:"parked_at,omitempty"`
	ParkedReason string     `json:"parked_reason,omitempty"`
	HeldBack     int64      `json:"held_back"`
	WaitsFor     int64      `json:"waits_for,omitempty"`
	DeliverAt    *time.Time `json:"deliver_at,omitempty"`
	Scheduled    bool       `json:"scheduled"`
}

func stuckCmd() *cobra.Command {
	var (
		olderThan      time.Duration
		limit          int
		parked, asJSON bool
		scheduled      bool
	)
	cmd := &cobra.Command{
		Use:   "stuck",
		Short: "List events that have not gone out: old pending, held and (with --parked, --scheduled) parked and scheduled ones",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return withAdmin(cmd, "outbox-stuck", func(ctx context.Context, e *app, st *admin.Admin) error {
				if !cmd.Flags().Changed("older-than") {
					olderThan = e.cfg.Stuck.After
				}
				if olderThan <= 0 {
					return usagef("--older-than: must be a positive duration such as 5m")
				}
				if limit < 1 || limit > admin.MaxSelected {
					return usagef("--limit: %d is not between 1 and %d", limit, admin.MaxSelected)
				}
				events, err := st.Stuck(ctx, admin.StuckOptions{OlderThan: olderThan, Limit: limit,
					IncludeParked: parked, IncludeScheduled: scheduled})
				if err != nil {
					return err
				}
				now := time.Now()
				out := make([]stuckJSON, 0, len(events))
				for _, ev := range events {
					j := stuckJSON{Seq: ev.Seq, ID: ev.ID, AggregateID: ev.AggregateID, Type: ev.Type, CreatedAt: ev.CreatedAt,
						AgeSeconds: seconds(now.Sub(ev.CreatedAt)), Attempts: ev.Attempts, LastError: ev.LastError,
						Held: ev.Held, ParkedReason: ev.ParkedReason, HeldBack: ev.HeldBack, WaitsFor: ev.WaitsFor,
						Scheduled: ev.Scheduled}
					if !ev.DeliverAt.IsZero() {
						j.DeliverAt = &ev.DeliverAt
					}
					if !ev.RetryAt.IsZero() {
						j.RetryAt = &ev.RetryAt
					}
					if !ev.ParkedAt.IsZero() {
						j.ParkedAt = &ev.ParkedAt
					}
					out = append(out, j)
				}
				if asJSON {
					if err := writeJSON(e.out, out); err != nil {
						return err
					}
					return noMatch(int64(len(out)))
				}
				if len(out) == 0 {
					fmt.Fprintf(e.out, "no stuck events (none pending for over %s, none held)\n", human(olderThan))
					return errNoMatch
				}
				tw := tabwriter.NewWriter(e.out, 0, 4, 2, ' ', 0)
				fmt.Fprintln(tw, "SEQ\tTYPE\tAGGREGATE\tAGE\tATTEMPTS\tSTATE\tHELD BACK\tLAST ERROR")
				for _, j := range out {
					fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s\t%d\t%s\n", j.Seq, j.Type, j.AggregateID,
						human(time.Duration(j.AgeSeconds*float64(time.Second))), j.Attempts, stuckState(j), j.HeldBack,
						oneLine(j.LastError, 80))
				}
				if err := tw.Flush(); err != nil {
					return err
				}
				if len(out) == limit {
					fmt.Fprintf(e.out, "(first %d shown; raise --limit for more)\n", limit)
				}
				return nil
			})
		},
	}
	f := cmd.Flags()
	f.DurationVar(&olderThan, "older-than", 0, "list pending events older than this (default stuck.after)")
	f.IntVar(&limit, "limit", 100, "at most this many, oldest first")
	f.BoolVar(&parked, "parked", false, "include parked events")
	f.BoolVar(&scheduled, "scheduled", false, "include events waiting for their deliver-at time")
	f.BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func stuckState(j stuckJSON) string {
	switch {
	case j.ParkedAt != nil:
		return "parked: " + oneLine(j.ParkedReason, 40)
	case j.Held:
		return "held"
	case j.Scheduled:
		return "scheduled for " + j.DeliverAt.UTC().Format(time.RFC3339)
	case j.RetryAt != nil:
		return "retry at " + j.RetryAt.UTC().Format(time.RFC3339)
	case j.WaitsFor != 0:
		return fmt.Sprintf("waits for %d", j.WaitsFor)
	default:
		return "pending"
	}
}

func oneLine(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > n {
		s = s[:n] + "..."
	}
	return s
}

// selectorFlags declares the flags of a admin.Selector on cmd. The returned
// function fills in the time range once the flags are parsed.
func selectorFlags(cmd *cobra.Command, sel *admin.Selector) (parseTimes func() error) {
	var after, before string
	f := cmd.Flags()
	f.Int64SliceVar(&sel.Seqs, "seq", nil, "event positions, as outbox stuck lists them (repeat or separate with commas)")
	f.Int64Var(&sel.FromSeq, "from-seq", 0, "first event position of a range")
	f.Int64Var(&sel.ToSeq, "to-seq", 0, "last event position of a range (inclusive)")
	// The names before migration 5 renamed the column id to seq.
	f.Int64SliceVar(&sel.Seqs, "id", nil, "")
	f.Int64Var(&sel.FromSeq, "from-id", 0, "")
	f.Int64Var(&sel.ToSeq, "to-id", 0, "")
	for _, old := range []string{"id", "from-id", "to-id"} {
		_ = f.MarkDeprecated(old, "use --"+strings.Replace(old, "id", "seq", 1))
	}
	f.StringVar(&sel.AggregateID, "aggregate", "", "aggregate key, exactly as written")
	f.StringVar(&sel.Type, "type", "", "exact event type")
	f.StringVar(&after, "created-after", "", "created at or after: RFC 3339 time or a duration ago (36h)")
	f.StringVar(&before, "created-before", "", "created before: RFC 3339 time or a duration ago")
	return func() error {
		var err error
		if sel.CreatedAfter, err = parseWhen("created-after", after); err != nil {
			return err
		}
		sel.CreatedBefore, err = parseWhen("created-before", before)
		return err
	}
}

type countJSON struct {
	Selector string `json:"selector"`
	Count    int64  `json:"count"`
}

// poisonCmd builds retry, park and unpark, which differ in the store call.
func poisonCmd(use, short, verb string, run func(ctx context.Context, st *admin.Admin, sel admin.Selector, reason string) (int64, error)) *cobra.Command {
	var (
		sel        admin.Selector
		parseTimes func() error
		reason     string
		asJSON     bool
	)
	cmd := &cobra.Command{
		Use:   use,
		Short: short,
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := parseTimes(); err != nil {
				return usageError(err)
			}
			if err := sel.Validate(); err != nil {
				return usageError(err)
			}
			if use == "park" && strings.TrimSpace(reason) == "" {
				return usagef("--reason is required: say why the events are set aside")
			}
			return withAdmin(cmd, "outbox-"+use, func(ctx context.Context, e *app, st *admin.Admin) error {
				n, err := run(ctx, st, sel, reason)
				if err != nil {
					return err
				}
				if asJSON {
					if err := writeJSON(e.out, countJSON{Selector: sel.String(), Count: n}); err != nil {
						return err
					}
					return noMatch(n)
				}
				fmt.Fprintf(e.out, "%s %s (%s)\n", verb, events(n), sel)
				if n == admin.MaxSelected {
					fmt.Fprintf(e.out, "that is the per-call maximum; run again for the rest\n")
				}
				return noMatch(n)
			})
		},
	}
	parseTimes = selectorFlags(cmd, &sel)
	if use == "park" {
		cmd.Flags().StringVar(&reason, "reason", "", "why the events are set aside (required)")
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func retryCmd() *cobra.Command {
	return poisonCmd("retry", "Make failed events (held or backing off) available to the relay now", "released",
		func(ctx context.Context, st *admin.Admin, sel admin.Selector, _ string) (int64, error) {
			return st.Retry(ctx, sel)
		})
}

func parkCmd() *cobra.Command {
	return poisonCmd("park", "Set pending events aside with a reason; later events of their aggregates go ahead", "parked",
		func(ctx context.Context, st *admin.Admin, sel admin.Selector, reason string) (int64, error) {
			return st.Park(ctx, sel, reason)
		})
}

func unparkCmd() *cobra.Command {
	return poisonCmd("unpark", "Put parked events back in the pending set, with the same identity", "unparked",
		func(ctx context.Context, st *admin.Admin, sel admin.Selector, _ string) (int64, error) {
			return st.Unpark(ctx, sel)
		})
}
