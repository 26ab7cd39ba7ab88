package main

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
)

// faultGroups name the fault kinds by what they do, for the comparison.
var faultGroups = map[string]string{
	KillRelay:   "kill",
	KillAll:     "kill",
	KillStorm:   "kill",
	PauseRelay:  "freeze (relay)",
	FreezeRelay: "freeze (relay)",
	RestartPG:   "PostgreSQL restart",
	CrashPG:     "PostgreSQL restart",
	RestartMQ:   "broker restart",
	FreezeMQ:    "broker freeze",
	BlackHole:   "broker network",
	HalfOpen:    "broker network",
	CutRelayDB:  "relay's PostgreSQL network",
}

// PrintComparison writes one table of the duplicates each fault kind left,
// one column per run (broker, relay mode and publisher), and the run's
// totals under it: the plain and the exactly-once path side by side.
// A cell is the duplicates received from the faults of that kind on
// (each fault's window runs until the next fault), and how many faults.
func PrintComparison(w io.Writer, reps []*Report) {
	if len(reps) == 0 {
		return
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	head := []string{"fault kind", "what it is"}
	for _, r := range reps {
		path := "plain"
		if r.ExactlyOnce {
			path = "exactly-once"
		}
		head = append(head, fmt.Sprintf("%s %s %s", r.Broker, r.Mode, path))
	}
	line := func(cells ...string) { fmt.Fprintln(tw, strings.Join(cells, "\t")+"\t") }
	line(head...)
	for _, f := range AllFaults {
		cells := []string{f, faultGroups[f]}
		ran := false
		for _, r := range reps {
			ds := r.FaultDuplicates[f]
			if r.Faults[f] == 0 && len(ds) == 0 {
				cells = append(cells, "-")
				continue
			}
			ran = true
			sum := 0
			for _, d := range ds {
				sum += d
			}
			cells = append(cells, fmt.Sprintf("%d (x%d)", sum, r.Faults[f]))
		}
		if ran {
			line(cells...)
		}
	}
	total := func(name, what string, v func(r *Report) string) {
		cells := []string{name, what}
		for _, r := range reps {
			cells = append(cells, v(r))
		}
		line(cells...)
	}
	total("all faults", "duplicates before dedupe", func(r *Report) string { return fmt.Sprint(r.Duplicates) })
	total("", "of events committed", func(r *Report) string {
		if r.Committed == 0 {
			return "-"
		}
		return fmt.Sprintf("%.3f%% of %d", 100*float64(r.Duplicates)/float64(r.Committed), r.Committed)
	})
	total("", "lost / phantom / order", func(r *Report) string {
		return fmt.Sprintf("%d / %d / %d", r.Lost, r.Phantom, r.OrderViolations)
	})
	total("", "relay faults mid-claim", func(r *Report) string { return fmt.Sprint(r.MidClaim) })
	_ = tw.Flush()
}
