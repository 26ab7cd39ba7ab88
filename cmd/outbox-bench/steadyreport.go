package main

import (
	"fmt"
	"time"
)

// baselineOf finds the previous release's row beside one of this build's.
func (r *report) baselineOf(x steadyRow) (steadyRow, bool) {
	for _, o := range r.Steady {
		if o.Version != thisBuild && o.Kind == x.Kind && o.Path == x.Path && o.Relays == x.Relays && o.Rate == x.Rate {
			return o, true
		}
	}
	return steadyRow{}, false
}

// ratio is new over old, as text; "-" when either is missing.
func ratio(newer, older float64) string {
	if newer <= 0 || older <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.2fx", newer/older)
}

// idleText is an idle relay's CPU per second, its process's and its
// sessions'.
func idleText(x steadyRow) string {
	ms := func(d time.Duration) string { return fmt.Sprintf("%.1f", float64(d)/1e6) }
	return ms(x.IdleRelay) + " + " + ms(x.IdleDB)
}

func (x steadyRow) perEvent(d time.Duration) float64 { return perEventUS(d, int64(x.Events)) }

func (r *report) steadyTables() []table {
	if len(r.Steady) == 0 && r.SteadyNote == "" {
		return nil
	}
	base := r.SteadyBaseline
	if base == "" {
		base = "previous release"
	}
	note := func(x steadyRow) string {
		if r.SteadyNote != "" {
			return x.Note + "; " + r.SteadyNote
		}
		return x.Note
	}
	lat := table{Title: fmt.Sprintf("Steady state: commit-to-consumer latency, `outbox relay` processes, one event per transaction, this build next to %s", base),
		Head: []string{"broker", "relays", "rate", "achieved/s, new / old", "p50", "p99", base + " p50", base + " p99", "p50 new/old", "p99 new/old", "undelivered", "notes"}}
	cpu := table{Title: fmt.Sprintf("Steady state: CPU per event, one `outbox relay` process and its PostgreSQL sessions, one event per transaction, this build next to %s", base),
		Head: []string{"mode", "rate", "achieved/s, new / old", "relay us/event", "PostgreSQL us/event", "total us/event", base + " relay", base + " PostgreSQL", base + " total", "total new/old", "idle CPU, ms/s: new / old", "notes"}}
	us := func(v float64) string { return fmt.Sprintf("%.0f", v) }
	for _, x := range r.Steady {
		if x.Version != thisBuild {
			continue
		}
		o, ok := r.baselineOf(x)
		switch x.Kind {
		case steadyLatency:
			if x.Events == 0 {
				lat.Rows = append(lat.Rows, []string{x.Path, fmt.Sprint(x.Relays), fmt.Sprint(x.Rate), "-", "-", "-", "-", "-", "-", "-", "-", note(x)})
				continue
			}
			op50, op99 := "-", "-"
			achieved := perSec(x.Achieved)
			n := note(x)
			if ok && o.Events > 0 {
				op50, op99 = fmtDur(o.P50), fmtDur(o.P99)
				achieved += " / " + perSec(o.Achieved)
				if o.Missing > 0 {
					n += fmt.Sprintf("; %s: %d undelivered", base, o.Missing)
				}
			} else if ok {
				n += "; " + base + ": " + o.Note
			}
			lat.Rows = append(lat.Rows, []string{x.Path, fmt.Sprint(x.Relays), fmt.Sprint(x.Rate), achieved,
				fmtDur(x.P50), fmtDur(x.P99), op50, op99, ratio(float64(x.P50), float64(o.P50)), ratio(float64(x.P99), float64(o.P99)),
				fmt.Sprint(x.Missing), n})
		case steadyCPU:
			if x.Events == 0 {
				cpu.Rows = append(cpu.Rows, []string{x.Path, fmt.Sprint(x.Rate), "-", "-", "-", "-", "-", "-", "-", "-", "-", note(x)})
				continue
			}
			total := x.perEvent(x.RelayCPU + x.DBCPU)
			orelay, odb, ototal, oidle, oachieved := "-", "-", "-", "-", "-"
			var oTotal float64
			n := note(x)
			if ok && o.Events > 0 {
				oTotal = o.perEvent(o.RelayCPU + o.DBCPU)
				orelay, odb, ototal, oidle = us(o.perEvent(o.RelayCPU)), us(o.perEvent(o.DBCPU)), us(oTotal), idleText(o)
				oachieved = perSec(o.Achieved)
			} else if ok {
				n += "; " + base + ": " + o.Note
			}
			cpu.Rows = append(cpu.Rows, []string{x.Path, fmt.Sprint(x.Rate), perSec(x.Achieved) + " / " + oachieved, us(x.perEvent(x.RelayCPU)), us(x.perEvent(x.DBCPU)), us(total),
				orelay, odb, ototal, ratio(total, oTotal), idleText(x) + " / " + oidle, n})
		}
	}
	var ts []table
	for _, t := range []table{lat, cpu} {
		if len(t.Rows) > 0 {
			ts = append(ts, t)
		}
	}
	return ts
}

// steadyGoals holds the steady rows to their targets: at 1,000 events/s,
// three relays deliver within p50 3 ms and p99 10 ms, never slower than
// the previous release in the same run, and an event costs at most the
// mode's CPU budget.
func (r *report) steadyGoals(add func(name, target, measured string, met bool)) {
	budget := map[string]float64{modeTable: 150, modeLog: 200, modeLogOnly: 120}
	for _, x := range r.Steady {
		if x.Version != thisBuild || x.Rate != 1000 || x.Events == 0 {
			continue
		}
		o, ok := r.baselineOf(x)
		ok = ok && o.Events > 0
		switch {
		case x.Kind == steadyLatency && x.Relays == 3:
			vs := ""
			if ok {
				vs = fmt.Sprintf("; %s: p50 %s, p99 %s", o.Version, fmtDur(o.P50), fmtDur(o.P99))
			}
			add("steady commit-to-consumer at 1,000 events/s, 3 relays, "+x.Path, "p50 <= 3 ms, p99 < 10 ms, not above the previous release",
				fmt.Sprintf("p50 %s, p99 %s%s", fmtDur(x.P50), fmtDur(x.P99), vs),
				x.P50 <= 3*time.Millisecond && x.P99 < 10*time.Millisecond && x.Missing == 0 && (!ok || (x.P50 <= o.P50 && x.P99 <= o.P99)))
		case x.Kind == steadyCPU:
			want := budget[x.Path]
			total := x.perEvent(x.RelayCPU + x.DBCPU)
			vs := ""
			if ok {
				vs = fmt.Sprintf("; %s: %.0f us", o.Version, o.perEvent(o.RelayCPU+o.DBCPU))
			}
			add("steady CPU per event at 1,000 events/s, "+x.Path+" mode, relay and its PostgreSQL sessions", fmt.Sprintf("<= %.0f us", want),
				fmt.Sprintf("%.0f us (relay %.0f, PostgreSQL %.0f)%s", total, x.perEvent(x.RelayCPU), x.perEvent(x.DBCPU), vs), total <= want)
		}
	}
}
