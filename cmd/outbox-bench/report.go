package main

import (
	_ "embed"
	"encoding/json"
	"fmt"
	"html"
	"io"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/outboxhq/outbox/core"
)

type latencyRow struct {
	Rate     int // events/s asked of the producers
	Wakeups  bool
	Path     string // "in process" (counting publisher) or the broker of an end-to-end row
	Note     string
	Achieved float64 // events/s the producers committed
	Events   int
	P50, P99 time.Duration
	P999     time.Duration
	Max      time.Duration
	Missing  int  // committed but not published by the end of the run
	Alone    bool // the broker without the relay: timed from the publish call
}

type producerRow struct {
	Section   string
	Name      string
	Producers int
	TxPerSec  float64
	MeanTx    time.Duration
}

type brokerRow struct {
	Broker   string
	Relay    rate
	Direct   rate
	Measured bool
	Note     string
}

type backlogRow struct {
	Backlog      int
	PayloadBytes int
	Drained      rate
	ClaimP50     time.Duration
	ClaimP99     time.Duration
	ExplainMs    float64 // EXPLAIN ANALYZE of the store's ordered claim, before the drain
	PeakHeapMiB  float64
	PeakRSSMiB   float64
}

type goal struct {
	Name, Target, Measured string
	Met                    bool
}

type report struct {
	Config            config
	Env               env
	Started, Finished time.Time

	Drain    []rate
	Latency  []latencyRow
	Notify   []producerRow
	Producer []producerRow
	Brokers  []brokerRow
	Replicas []rate
	Backlogs []backlogRow
	// The producers section.
	Bulk           []bulkRow
	Migration7     []bulkRow
	Claims         []claimRow
	Migration7Took time.Duration
	Goals          []goal

	// The steady-state rows, this build's and the previous release's.
	Steady         []steadyRow
	SteadyBaseline string // the previous release's revision, when it ran
	SteadyNote     string // why a version did not run

	// The exactly-once rows: Kafka plain and exactly-once, side by side.
	EOS     []eosRow
	EOSNote string // why they did not run
}

func (r *report) drain(name string) (rate, bool) {
	for _, d := range r.Drain {
		if d.Name == name {
			return d, true
		}
	}
	return rate{}, false
}

// evaluate checks the figures of this run against the goals, pair by pair.
func (r *report) evaluate() {
	r.Goals = nil
	add := func(name, target, measured string, met bool) {
		r.Goals = append(r.Goals, goal{name, target, measured, met})
	}
	floor, okF := r.drain("SQL floor")
	wmDefault, okW := r.drain("Watermill forwarder, default schema")
	for _, mode := range []string{nameBinaryOrdered, nameBinaryUnordered, nameOrdered, nameUnordered} {
		d, ok := r.drain(mode)
		if !ok {
			continue
		}
		binary := mode == nameBinaryOrdered || mode == nameBinaryUnordered
		if okF && floor.PerSec() > 0 && (binary || !r.hasBinary()) {
			x := d.PerSec() / floor.PerSec()
			add(mode+" vs SQL floor", ">= 80%", fmt.Sprintf("%.0f%%", 100*x), x >= 0.8)
		}
		if okW && wmDefault.PerSec() > 0 && binary {
			x := d.PerSec() / wmDefault.PerSec()
			add(mode+" vs Watermill default schema", ">= 10x", fmt.Sprintf("%.1fx", x), x >= 10)
		}
	}
	// A broker relay is held to what limits it: the relay itself (the same
	// relay with a counting publisher) or the broker (its Watermill
	// publisher driven directly at its best concurrency), whichever is
	// slower.
	counting, okC := r.drain(nameOrdered)
	for _, b := range r.Brokers {
		if !b.Measured || b.Direct.PerSec() == 0 {
			continue
		}
		limit, by := b.Direct.PerSec(), "direct"
		if okC && counting.PerSec() > 0 && counting.PerSec() < limit {
			limit, by = counting.PerSec(), "counting relay"
		}
		x := b.Relay.PerSec() / limit
		add(b.Broker+": relay vs min(relay with a counting publisher, direct at its best concurrency)", ">= 80%",
			fmt.Sprintf("%.0f%% (%s vs %s, %s)", 100*x, perSec(b.Relay.PerSec()), perSec(limit), by), x >= 0.8)
	}
	for _, l := range r.Latency {
		if l.Rate != 1000 || !l.Wakeups || l.Alone || l.Path == "" || l.Path == "in process" {
			continue
		}
		if l.Events == 0 {
			add("commit-to-delivery p99 at 1,000 events/s, "+l.Path, "< 10 ms", l.Note, false)
			continue
		}
		add("commit-to-delivery p99 at 1,000 events/s, "+l.Path, "< 10 ms",
			fmt.Sprintf("p99 %s (p50 %s, p99.9 %s, max %s)%s", fmtDur(l.P99), fmtDur(l.P50), fmtDur(l.P999), fmtDur(l.Max), r.brokerAlone(l.Path, l.Rate)),
			l.P99 < 10*time.Millisecond && l.Missing == 0)
	}
	r.steadyGoals(add)
	r.eosGoals(add)
	// What producers pay: each variant against the transaction of two
	// business rows it replaces one of, at 1 and 16 producers.
	producerGoals := []struct {
		name, base string
		producers  int
		want       float64
	}{
		{nameWithEvent, nameTwoRows, 1, 0.9},
		{nameWithEvent, nameTwoRows, 16, 0.75},
		{nameSQLWithEvent, nameSQLTwoRows, 1, 0.9},
		{nameSQLWithEvent, nameSQLTwoRows, 16, 0.75},
		{nameSQLEventDrained, nameSQLTwoRows, 16, 0.75},
		{nameWithLogEvent, nameTwoRows, 16, 0.9},
	}
	for _, g := range producerGoals {
		base, with := r.producer(g.base, g.producers), r.producer(g.name, g.producers)
		if base > 0 && with > 0 {
			x := with / base
			add(fmt.Sprintf("producer: %s, %d producer(s), vs two business rows", g.name, g.producers),
				fmt.Sprintf(">= %.2fx", g.want), fmt.Sprintf("%.2fx (%s vs %s tx/s)", x, perSec(with), perSec(base)), x >= g.want)
		}
	}
	// Ordered replicas own partitions of their own: more of them must not
	// drain less in total.
	if len(r.Replicas) == 3 && r.Replicas[0].PerSec() > 0 {
		one := r.Replicas[0].PerSec()
		for i, k := range []int{2, 4} {
			x := r.Replicas[i+1].PerSec() / one
			add(fmt.Sprintf("ordered relays: %d vs 1, total events/s", k), ">= 0.95x",
				fmt.Sprintf("%.2fx (%s vs %s)", x, perSec(r.Replicas[i+1].PerSec()), perSec(one)), x >= 0.95)
		}
	}
	if len(r.Backlogs) >= 2 && r.Backlogs[0].ClaimP50 > 0 {
		s, b := r.Backlogs[0], r.Backlogs[1]
		x := float64(b.ClaimP50) / float64(s.ClaimP50)
		add(fmt.Sprintf("claim time, %s vs %s backlog", count(b.Backlog), count(s.Backlog)), "within 1.5x",
			fmt.Sprintf("p50 %s vs %s (%.1fx)", fmtDur(b.ClaimP50), fmtDur(s.ClaimP50), x), x <= 1.5)
		if s.PeakRSSMiB > 0 {
			m := b.PeakRSSMiB / s.PeakRSSMiB
			add("relay peak RSS, large vs small backlog", "does not grow (within 1.5x)",
				fmt.Sprintf("%.0f MiB vs %.0f MiB", b.PeakRSSMiB, s.PeakRSSMiB), m <= 1.5)
		}
	}
}

// hasBinary reports whether the run drove the outbox binary: its rows
// then carry the throughput goal, and the library's are for comparison.
func (r *report) hasBinary() bool {
	d, ok := r.drain(nameBinaryOrdered)
	return ok && d.Events > 0
}

// brokerAlone says what the broker of an end-to-end path gave alone at
// the same rate, the share of the path's latency the relay cannot remove.
func (r *report) brokerAlone(path string, rate int) string {
	name, _, _ := strings.Cut(path, ", log mode")
	for _, l := range r.Latency {
		if l.Alone && l.Rate == rate && l.Path == name+", broker alone" && l.Events > 0 {
			return fmt.Sprintf("; the broker alone: p99 %s (p50 %s, max %s)", fmtDur(l.P99), fmtDur(l.P50), fmtDur(l.Max))
		}
	}
	return ""
}

func (r *report) producer(name string, producers int) float64 {
	for _, p := range r.Producer {
		if p.Name == name && p.Producers == producers {
			return p.TxPerSec
		}
	}
	return 0
}

func count(n int) string {
	switch {
	case n >= 1_000_000 && n%1_000_000 == 0:
		return fmt.Sprintf("%dM", n/1_000_000)
	case n >= 1000 && n%1000 == 0:
		return fmt.Sprintf("%dk", n/1000)
	default:
		return fmt.Sprint(n)
	}
}

func perSec(v float64) string {
	switch {
	case v >= 10_000:
		return fmt.Sprintf("%.0fk", v/1000)
	case v >= 1000:
		return fmt.Sprintf("%.1fk", v/1000)
	default:
		return fmt.Sprintf("%.0f", v)
	}
}

func mark(ok bool) string {
	if ok {
		return "met"
	}
	return "MISSED"
}

// table is one titled grid, shared by the text and Markdown outputs.
type table struct {
	Title string
	Head  []string
	Rows  [][]string
}

func (r *report) tables() []table {
	var ts []table
	if len(r.Drain) > 0 {
		t := table{Title: fmt.Sprintf("Drain throughput: backlog of %s events, counting publisher", count(r.Config.Backlog)),
			Head: []string{"drainer", "events/s", "drained", "time", "vs SQL floor", "CPU per 1k events, relay / PostgreSQL", "notes"}}
		floor, _ := r.drain("SQL floor")
		for _, d := range r.Drain {
			vs := "-"
			if floor.PerSec() > 0 {
				vs = fmt.Sprintf("%.0f%%", 100*d.PerSec()/floor.PerSec())
			}
			t.Rows = append(t.Rows, []string{d.Name, perSec(d.PerSec()), fmt.Sprint(d.Events), fmtDur(d.Elapsed), vs, d.cpuPer1k(), d.Note})
		}
		ts = append(ts, t)
	}
	if len(r.Latency) > 0 {
		t := table{Title: "Commit-to-delivery latency at fixed producer rates",
			Head: []string{"path", "rate", "wake-ups", "achieved/s", "events", "p50", "p99", "p99.9", "max", "undelivered", "notes"}}
		for _, l := range r.Latency {
			w := "off (poll 1s)"
			if l.Wakeups {
				w = "on"
			}
			if l.Alone {
				w = "-"
			}
			path := l.Path
			if path == "" {
				path = "in process"
			}
			if l.Events == 0 && l.Note != "" {
				t.Rows = append(t.Rows, []string{path, fmt.Sprint(l.Rate), w, "-", "-", "-", "-", "-", "-", "-", l.Note})
				continue
			}
			t.Rows = append(t.Rows, []string{path, fmt.Sprint(l.Rate), w, perSec(l.Achieved), fmt.Sprint(l.Events),
				fmtDur(l.P50), fmtDur(l.P99), fmtDur(l.P999), fmtDur(l.Max), fmt.Sprint(l.Missing), l.Note})
		}
		ts = append(ts, t)
	}
	ts = append(ts, r.steadyTables()...)
	ts = append(ts, r.eosTable()...)
	prod := func(title string, rows []producerRow) {
		if len(rows) == 0 {
			return
		}
		t := table{Title: title, Head: []string{"variant", "producers", "tx/s", "mean tx"}}
		for _, p := range rows {
			t.Rows = append(t.Rows, []string{p.Name, fmt.Sprint(p.Producers), perSec(p.TxPerSec), fmtDur(p.MeanTx)})
		}
		ts = append(ts, t)
	}
	prod("Producer cost of the NOTIFY: one event per transaction, a relay listening", r.Notify)
	prod("What producers pay: a transaction of two business rows, and the same with the second row an event (fsync on)", r.Producer)
	if len(r.Brokers) > 0 {
		t := table{Title: "Brokers: relay throughput next to the same Watermill publisher driven directly",
			Head: []string{"broker", "relay events/s", "direct events/s", "relay/direct", "notes"}}
		for _, b := range r.Brokers {
			if !b.Measured {
				t.Rows = append(t.Rows, []string{b.Broker, "not measured", "not measured", "-", b.Note})
				continue
			}
			ratio := "-"
			if b.Direct.PerSec() > 0 {
				ratio = fmt.Sprintf("%.0f%%", 100*b.Relay.PerSec()/b.Direct.PerSec())
			}
			t.Rows = append(t.Rows, []string{b.Broker, perSec(b.Relay.PerSec()), perSec(b.Direct.PerSec()), ratio, b.Note})
		}
		ts = append(ts, t)
	}
	if len(r.Replicas) > 0 {
		t := table{Title: fmt.Sprintf("Replicas: relays on separate pools sharing a backlog of %s, ordered", count(r.Config.ReplicaLoad)),
			Head: []string{"replicas", "events/s", "drained", "time", "vs 1 replica"}}
		for _, x := range r.Replicas {
			t.Rows = append(t.Rows, []string{x.Name, perSec(x.PerSec()), fmt.Sprint(x.Events), fmtDur(x.Elapsed),
				fmt.Sprintf("%.2fx", x.PerSec()/r.Replicas[0].PerSec())})
		}
		ts = append(ts, t)
	}
	if len(r.Backlogs) > 0 {
		t := table{Title: "Backlog size: one relay process (ordered) draining a small and a large backlog, and one of large payloads",
			Head: []string{"backlog", "payload", "events/s", "drained", "claim p50", "claim p99", "claim EXPLAIN ANALYZE", "peak Go heap", "peak RSS"}}
		for _, x := range r.Backlogs {
			t.Rows = append(t.Rows, []string{count(x.Backlog), bytesText(x.PayloadBytes), perSec(x.Drained.PerSec()), fmt.Sprint(x.Drained.Events),
				fmtDur(x.ClaimP50), fmtDur(x.ClaimP99), fmt.Sprintf("%.1f ms", x.ExplainMs),
				fmt.Sprintf("%.0f MiB", x.PeakHeapMiB), fmt.Sprintf("%.0f MiB", x.PeakRSSMiB)})
		}
		ts = append(ts, t)
	}
	bulk := func(title string, rows []bulkRow) {
		if len(rows) == 0 {
			return
		}
		t := table{Title: title, Head: []string{"variant", "events per transaction", "events/s", "mean tx"}}
		for _, x := range rows {
			t.Rows = append(t.Rows, []string{x.Name, fmt.Sprint(x.PerTx), perSec(x.EventsPerSec), fmtDur(x.MeanTx)})
		}
		ts = append(ts, t)
	}
	bulk("Producers: events per transaction, one producer, against plain INSERTs of the same rows", r.Bulk)
	bulk("Producer cost of migration 7: the writer's transaction on the same table before and after", r.Migration7)
	if len(r.Claims) > 0 {
		t := table{Title: fmt.Sprintf("Claim cost of migration 7: ordered claims of %d on one backlog (migration applied in place in %s)", effective(core.Options{BatchSize: r.Config.BatchSize}).BatchSize, fmtDur(r.Migration7Took)),
			Head: []string{"table", "backlog", "claim p50", "claim p90"}}
		for _, x := range r.Claims {
			t.Rows = append(t.Rows, []string{x.Name, count(x.Backlog), fmtDur(x.P50), fmtDur(x.P90)})
		}
		ts = append(ts, t)
	}
	if len(r.Goals) > 0 {
		t := table{Title: "Goals", Head: []string{"goal", "target", "measured", "result"}}
		for _, g := range r.Goals {
			t.Rows = append(t.Rows, []string{g.Name, g.Target, g.Measured, mark(g.Met)})
		}
		ts = append(ts, t)
	}
	return ts
}

func (r *report) printText(w io.Writer) {
	for _, t := range r.tables() {
		fmt.Fprintf(w, "\n%s\n", t.Title)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, strings.Join(t.Head, "\t"))
		for _, row := range t.Rows {
			fmt.Fprintln(tw, strings.Join(row, "\t"))
		}
		tw.Flush()
	}
}

//go:embed analysis.md
var analysis string

func (r *report) write(path, chart string) error {
	if chart == "" {
		chart = strings.TrimSuffix(path, filepath.Ext(path)) + ".svg"
	}
	if err := os.WriteFile(chart, []byte(r.chart()), 0o644); err != nil {
		return fmt.Errorf("write chart: %w", err)
	}
	rel, err := filepath.Rel(filepath.Dir(path), chart)
	if err != nil {
		rel = chart
	}
	raw, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return fmt.Errorf("encode figures: %w", err)
	}
	if err := os.WriteFile(strings.TrimSuffix(path, filepath.Ext(path))+".json", raw, 0o644); err != nil {
		return fmt.Errorf("write figures: %w", err)
	}
	var b strings.Builder
	r.markdown(&b, filepath.ToSlash(rel))
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		return fmt.Errorf("write report: %w", err)
	}
	return nil
}

// rerender writes the report again from saved figures, with the current
// text around them.
func rerender(c config) error {
	raw, err := os.ReadFile(c.Render)
	if err != nil {
		return fmt.Errorf("read figures: %w", err)
	}
	var r report
	if err := json.Unmarshal(raw, &r); err != nil {
		return fmt.Errorf("decode figures: %w", err)
	}
	out := c.Out
	if out == "" {
		out = strings.TrimSuffix(c.Render, filepath.Ext(c.Render)) + ".md"
	}
	r.evaluate()
	return r.write(out, c.Chart)
}

func (r *report) markdown(w io.Writer, chart string) {
	e := r.Env
	fmt.Fprintf(w, "# Benchmarks\n\n")
	fmt.Fprintf(w, "Generated by `make bench` (the program in `cmd/outbox-bench`) on %s; the run took %s. ",
		e.When.Format("2006-01-02 15:04 UTC"), r.Finished.Sub(r.Started).Round(time.Second))
	fmt.Fprintf(w, "Every figure, ratio and the chart below come from that one run against one PostgreSQL server. "+
		"Absolute numbers move from machine to machine; the ratios, taken pair by pair within the run, are what to compare. "+
		"Rerun it with `make bench` (about 10 minutes on 2 cores) or `make bench-quick` (small sizes, about two minutes).\n\n")
	fmt.Fprintf(w, "![Drain throughput](%s)\n\n", chart)
	fmt.Fprintf(w, "## Machine\n\n")
	fmt.Fprintf(w, "| | |\n|---|---|\n")
	fmt.Fprintf(w, "| CPU | %s, %d logical CPUs |\n| memory | %.0f GiB |\n| OS | %s/%s |\n| Go | %s |\n| PostgreSQL | %s, on loopback |\n| load average at start | %s |\n",
		orDash(e.CPU), e.CPUs, e.MemoryGiB, e.OS, e.Arch, e.GoVersion, e.PostgreSQL, orDash(e.LoadAvg))
	fmt.Fprintf(w, "\nPostgreSQL settings: ")
	var s []string
	for _, kv := range e.Settings {
		s = append(s, fmt.Sprintf("`%s=%s`", kv[0], kv[1]))
	}
	fmt.Fprintf(w, "%s.\n\n", strings.Join(s, ", "))
	fmt.Fprintf(w, "Durability: %s.\n\n", r.durability())
	c := r.Config
	o := effective(core.Options{BatchSize: c.BatchSize, Lanes: c.Lanes, Claimers: c.Claimers})
	fmt.Fprintf(w, "Run settings: %d aggregates, payloads of about %d bytes, drains capped at %s. "+
		"The `outbox relay` rows run the binary as shipped: its defaults, `--broker stdout` (or the broker named), "+
		"only the database and table set. The library rows are `core.Relay` over `table.Source` with batch %d, "+
		"%d lanes and %d claims open (the defaults unless the run's flags changed them).\n\n",
		c.Aggregates, c.PayloadBytes, c.DrainCap, o.BatchSize, o.Lanes, o.Claimers)
	for _, t := range r.tables() {
		fmt.Fprintf(w, "## %s\n\n", t.Title)
		fmt.Fprintf(w, "| %s |\n|%s\n", strings.Join(t.Head, " | "), strings.Repeat("---|", len(t.Head)))
		for _, row := range t.Rows {
			cells := make([]string, len(row))
			for i, v := range row {
				cells[i] = strings.ReplaceAll(v, "|", "\\|")
			}
			fmt.Fprintf(w, "| %s |\n", strings.Join(cells, " | "))
		}
		fmt.Fprintln(w)
	}
	fmt.Fprint(w, analysis)
}

// durability states whether the server ran with production durability.
func (r *report) durability() string {
	want := map[string]string{"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on"}
	var off []string
	for _, kv := range r.Env.Settings {
		if v, ok := want[kv[0]]; ok && kv[1] != v {
			off = append(off, kv[0]+"="+kv[1])
		}
	}
	if len(off) > 0 {
		return "NOT production durability (" + strings.Join(off, ", ") + "): figures for development only"
	}
	return "production (fsync, synchronous_commit and full_page_writes on), as PostgreSQL ships"
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// chart draws drain throughput as horizontal bars, one per drainer, from
// the report's own numbers.
func (r *report) chart() string {
	const (
		width, left, right, barH, gap, top = 760, 250, 90, 26, 10, 50
	)
	rows := r.Drain
	height := top + len(rows)*(barH+gap) + 30
	var peak float64
	for _, d := range rows {
		peak = max(peak, d.PerSec())
	}
	if peak == 0 {
		peak = 1
	}
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="13">`+"\n",
		width, height, width, height)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(&b, `<text x="%d" y="24" font-size="15" font-weight="bold">Drain throughput, events/s (backlog %s, same PostgreSQL, one run)</text>`+"\n",
		10, count(r.Config.Backlog))
	span := float64(width - left - right)
	for i, d := range rows {
		y := top + i*(barH+gap)
		w := span * d.PerSec() / peak
		color := "#9aa5b1"
		switch {
		case strings.HasPrefix(d.Name, "outbox relay"):
			color = "#2f6fde"
		case d.Name == "SQL floor":
			color = "#3c4858"
		}
		fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="end">%s</text>`+"\n", left-8, y+barH/2+5, html.EscapeString(d.Name))
		fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%.1f" height="%d" fill="%s"/>`+"\n", left, y, max(w, 1), barH, color)
		fmt.Fprintf(&b, `<text x="%.1f" y="%d">%s</text>`+"\n", float64(left)+max(w, 1)+6, y+barH/2+5, perSec(d.PerSec()))
	}
	fmt.Fprintf(&b, `<text x="10" y="%d" font-size="11" fill="#555">%s, PostgreSQL %s, %d CPUs; generated by make bench</text>`+"\n",
		height-10, html.EscapeString(r.Env.When.Format("2006-01-02")), html.EscapeString(r.Env.PostgreSQL), r.Env.CPUs)
	b.WriteString("</svg>\n")
	return b.String()
}

func bytesText(n int) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%.0f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.0f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}
