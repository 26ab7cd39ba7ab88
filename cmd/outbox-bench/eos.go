package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outboxhq/outbox/core/event"
)

// The exactly-once rows: the `outbox relay` binary publishing to Kafka
// (kfake, in this process) with its shipped defaults, plain and with
// brokers.kafka.exactly_once, one after the other in the same run: the
// drain of a backlog, and commit-to-consumer latency at 1,000 events/s
// with one and three relays. Every consumer reads committed records only
// (read_committed), as the exactly-once path's consumers must; without
// transactions that is every record, so both paths meet the same consumer.
// Each measurement gets a fresh cluster, so no run reads another's records
// or transactions.

// eosRow is one measurement of one Kafka path.
type eosRow struct {
	Kind        string // eosDrain or eosLatency
	ExactlyOnce bool
	Relays      int
	Rate        int       // latency rows: events/s asked of the producers
	Drain       rate      // drain rows
	Delivered   int64     // drain rows: records a read_committed consumer read
	Latency     steadyRow // latency rows
	Note        string
}

const (
	eosDrain   = "drain"
	eosLatency = "latency"
)

// The goals of the issue: the exactly-once path keeps most of the plain
// path's throughput, and delivers quickly at a steady rate.
const (
	eosThroughputGoal = 0.8
	eosP99Goal        = 20 * time.Millisecond
)

func eosPath(exactlyOnce bool) string {
	if exactlyOnce {
		return "exactly-once"
	}
	return "plain"
}

// eosCluster starts a fresh kfake cluster holding the bench topic, and
// the relay's settings to reach it on the path asked.
func eosCluster(exactlyOnce bool) (*kfake.Cluster, []string, error) {
	kf, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(4, benchTopic))
	if err != nil {
		return nil, nil, fmt.Errorf("start kfake: %w", err)
	}
	env := []string{"OUTBOX_BROKER=kafka", "OUTBOX_BROKERS_KAFKA_BROKERS=" + strings.Join(kf.ListenAddrs(), ","),
		"OUTBOX_ROUTING_TOPIC=" + benchTopic}
	if exactlyOnce {
		env = append(env, "OUTBOX_BROKERS_KAFKA_EXACTLY_ONCE=true")
	}
	return kf, env, nil
}

func (b *bench) eosSection(ctx context.Context, rep *report) error {
	if b.cfg.Outbox == "" {
		rep.EOSNote = "not measured: -outbox names no `outbox` binary (make bench builds bin/outbox)"
		return nil
	}
	// Drains first, the two paths interleaved over the rounds; each
	// path's best round counts.
	best := map[bool]eosRow{}
	for round := range max(1, b.cfg.Repeat) {
		for _, eos := range []bool{false, true} {
			b.settle(ctx)
			row, err := b.eosDrainRun(ctx, eos)
			if err != nil {
				if ctx.Err() != nil {
					return err
				}
				b.log.Warn("exactly-once drain not measured", "path", eosPath(eos), "round", round, "error", err)
				row = eosRow{Kind: eosDrain, ExactlyOnce: eos, Relays: 1, Note: "not measured: " + oneLine(err)}
			}
			if old, ok := best[eos]; !ok || row.Drain.PerSec() > old.Drain.PerSec() {
				best[eos] = row
			}
		}
	}
	rep.EOS = append(rep.EOS, best[false], best[true])
	for _, relays := range []int{1, 3} {
		for _, eos := range []bool{false, true} {
			b.settle(ctx)
			row, err := b.eosLatencyRun(ctx, eos, relays, 1000)
			if err != nil {
				if ctx.Err() != nil {
					return err
				}
				b.log.Warn("exactly-once latency not measured", "path", eosPath(eos), "relays", relays, "error", err)
				row = eosRow{Kind: eosLatency, ExactlyOnce: eos, Relays: relays, Rate: 1000, Note: "not measured: " + oneLine(err)}
			}
			rep.EOS = append(rep.EOS, row)
		}
	}
	return nil
}

// eosDrainRun times one relay over a backlog: from starting the process
// until every event is recorded as dispatched, which on either path comes
// after the broker acknowledged it (on the exactly-once path, after its
// transaction committed). Then a read_committed consumer counts what
// arrived.
func (b *bench) eosDrainRun(ctx context.Context, exactlyOnce bool) (eosRow, error) {
	n := b.cfg.EOSBacklog
	row := eosRow{Kind: eosDrain, ExactlyOnce: exactlyOnce, Relays: 1}
	kf, env, err := eosCluster(exactlyOnce)
	if err != nil {
		return row, err
	}
	defer kf.Close()
	cfg, drop, err := b.schema(ctx, "eos")
	if err != nil {
		return row, err
	}
	defer drop()
	if err := b.fill(ctx, cfg, n); err != nil {
		return row, err
	}
	start := time.Now()
	p, err := b.startBinary(ctx, cfg, env...)
	if err != nil {
		return row, err
	}
	defer func() { _ = p.stop() }()
	pending := int64(n)
	deadline := start.Add(b.cfg.DrainCap)
	for pending > 0 && time.Now().Before(deadline) && ctx.Err() == nil {
		if err := p.failed(); err != nil {
			return row, err
		}
		time.Sleep(20 * time.Millisecond)
		if pending, err = b.pendingCount(ctx, cfg); err != nil {
			return row, err
		}
	}
	elapsed := time.Since(start)
	dbCPU := b.sessionCPU(ctx, relayApplicationName)
	if err := p.stop(); err != nil {
		return row, err
	}
	row.Drain = rate{Name: "Kafka (kfake), " + eosPath(exactlyOnce), Events: int64(n) - pending, Elapsed: elapsed, DBCPU: dbCPU,
		RelayCPU: p.cmd.ProcessState.UserTime() + p.cmd.ProcessState.SystemTime()}
	row.Delivered, err = countCommitted(ctx, kf.ListenAddrs())
	if err != nil {
		return row, err
	}
	row.Note = "`outbox relay`, shipped defaults, one process; timed until every event is recorded dispatched"
	if pending > 0 {
		row.Note += fmt.Sprintf("; stopped after %s with %d of %d recorded", b.cfg.DrainCap, int64(n)-pending, n)
	}
	if row.Delivered != int64(n)-pending {
		row.Note += fmt.Sprintf("; the topic holds %d committed records for %d events recorded", row.Delivered, int64(n)-pending)
	}
	b.log.Info("kafka drain", "path", eosPath(exactlyOnce), "events", row.Drain.Events, "took", elapsed.Round(time.Millisecond),
		"per_sec", int(row.Drain.PerSec()), "committed_records", row.Delivered)
	return row, nil
}

// countCommitted reads the bench topic from the start as a read_committed
// consumer and counts its records, duplicates included, until no record
// came for two seconds.
func countCommitted(ctx context.Context, brokers []string) (int64, error) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(benchTopic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchIsolationLevel(kgo.ReadCommitted()))
	if err != nil {
		return 0, fmt.Errorf("kafka client: %w", err)
	}
	defer cl.Close()
	var n int64
	for {
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		fs := cl.PollFetches(pctx)
		cancel()
		got := 0
		fs.EachRecord(func(r *kgo.Record) {
			for _, h := range r.Headers {
				if h.Key == event.HeaderEventID {
					got++
				}
			}
		})
		n += int64(got)
		if ctx.Err() != nil {
			return n, ctx.Err()
		}
		// Two seconds without a record: the topic is read to its end.
		if got == 0 && pctx.Err() != nil {
			return n, nil
		}
	}
}

// eosLatencyRun is a steady-state latency row of this build on one path,
// the consumer reading committed records only.
func (b *bench) eosLatencyRun(ctx context.Context, exactlyOnce bool, relays, rate int) (eosRow, error) {
	row := eosRow{Kind: eosLatency, ExactlyOnce: exactlyOnce, Relays: relays, Rate: rate}
	kf, env, err := eosCluster(exactlyOnce)
	if err != nil {
		return row, err
	}
	defer kf.Close()
	br := e2eBroker{name: "Kafka (kfake), " + eosPath(exactlyOnce), relayEnv: env,
		consume: []string{"-broker", "kafka", "-url", strings.Join(kf.ListenAddrs(), ","), "-committed"}}
	c := steadyCase{kind: steadyLatency, path: br.name, mode: modeTable, relays: relays, rate: rate, broker: &br}
	lat, err := b.steadyRun(ctx, c, steadyVersion{Label: thisBuild, bin: b.cfg.Outbox})
	if err != nil {
		return row, err
	}
	row.Latency = lat
	row.Note = "`outbox relay` processes, shipped defaults; one INSERT per transaction; a read_committed consumer process stamps arrivals"
	return row, nil
}

func (r *report) eos(kind string, exactlyOnce bool, relays int) (eosRow, bool) {
	for _, x := range r.EOS {
		if x.Kind == kind && x.ExactlyOnce == exactlyOnce && x.Relays == relays {
			return x, true
		}
	}
	return eosRow{}, false
}

// eosTable sets the two paths side by side, each figure with its goal.
func (r *report) eosTable() []table {
	if len(r.EOS) == 0 && r.EOSNote == "" {
		return nil
	}
	t := table{Title: "Kafka exactly-once next to plain Kafka (kfake; `outbox relay` binary, shipped defaults; read_committed consumers)",
		Head: []string{"measure", "plain", "exactly-once", "exactly-once / plain", "goal", "result", "notes"}}
	if r.EOSNote != "" {
		t.Rows = append(t.Rows, []string{"-", "-", "-", "-", "-", "-", r.EOSNote})
		return []table{t}
	}
	notes := func(a, b eosRow) string {
		if a.Note == b.Note {
			return a.Note
		}
		var n []string
		for _, x := range []eosRow{a, b} {
			if x.Note != "" {
				n = append(n, eosPath(x.ExactlyOnce)+": "+x.Note)
			}
		}
		return strings.Join(n, "; ")
	}
	if p, ok := r.eos(eosDrain, false, 1); ok {
		e, _ := r.eos(eosDrain, true, 1)
		x := ratioOf(e.Drain.PerSec(), p.Drain.PerSec())
		t.Rows = append(t.Rows, []string{fmt.Sprintf("drain of %s events, 1 relay, events/s", count(r.Config.EOSBacklog)),
			orNot(p.Drain.Events > 0, perSec(p.Drain.PerSec())), orNot(e.Drain.Events > 0, perSec(e.Drain.PerSec())), ratioText(x),
			fmt.Sprintf(">= %.1fx", eosThroughputGoal), markIf(x > 0, x >= eosThroughputGoal),
			fmt.Sprintf("committed records read: plain %d, exactly-once %d; CPU per 1k events, relay / PostgreSQL: plain %s, exactly-once %s; %s",
				p.Delivered, e.Delivered, p.Drain.cpuPer1k(), e.Drain.cpuPer1k(), notes(p, e))})
	}
	for _, relays := range []int{1, 3} {
		p, ok := r.eos(eosLatency, false, relays)
		if !ok {
			continue
		}
		e, _ := r.eos(eosLatency, true, relays)
		pl, el := p.Latency, e.Latency
		what := fmt.Sprintf("commit to consumer at %d events/s, %d relay", p.Rate, relays)
		if relays > 1 {
			what += "s"
		}
		measured := el.Events > 0
		pm := pl.Events > 0
		n := fmt.Sprintf("achieved/s: plain %s, exactly-once %s; undelivered: plain %d, exactly-once %d; %s",
			perSec(pl.Achieved), perSec(el.Achieved), pl.Missing, el.Missing, notes(p, e))
		t.Rows = append(t.Rows,
			[]string{what + ", p50", orNot(pm, fmtDur(pl.P50)), orNot(measured, fmtDur(el.P50)), ratioText(ratioOf(float64(el.P50), float64(pl.P50))), "-", "-", n},
			[]string{what + ", p99", orNot(pm, fmtDur(pl.P99)), orNot(measured, fmtDur(el.P99)), ratioText(ratioOf(float64(el.P99), float64(pl.P99))),
				"< " + fmtDur(eosP99Goal), markIf(measured, el.P99 < eosP99Goal && el.Missing == 0), ""})
	}
	return []table{t}
}

// eosGoals adds the two goals for the exactly-once path.
func (r *report) eosGoals(add func(name, target, measured string, met bool)) {
	if p, ok := r.eos(eosDrain, false, 1); ok {
		e, _ := r.eos(eosDrain, true, 1)
		x := ratioOf(e.Drain.PerSec(), p.Drain.PerSec())
		measured := "not measured"
		if x > 0 {
			measured = fmt.Sprintf("%s (%s vs %s events/s)", ratioText(x), perSec(e.Drain.PerSec()), perSec(p.Drain.PerSec()))
		}
		add("Kafka exactly-once drain throughput vs plain Kafka, 1 relay", fmt.Sprintf(">= %.1fx", eosThroughputGoal), measured, x >= eosThroughputGoal)
	}
	for _, relays := range []int{1, 3} {
		e, ok := r.eos(eosLatency, true, relays)
		if !ok {
			continue
		}
		p, _ := r.eos(eosLatency, false, relays)
		measured := "not measured"
		if e.Latency.Events > 0 {
			measured = fmt.Sprintf("p99 %s, p50 %s (plain: p99 %s, p50 %s)", fmtDur(e.Latency.P99), fmtDur(e.Latency.P50),
				fmtDur(p.Latency.P99), fmtDur(p.Latency.P50))
		}
		add(fmt.Sprintf("Kafka exactly-once commit to consumer at %d events/s, %d relay(s)", e.Rate, relays), "p99 < "+fmtDur(eosP99Goal),
			measured, e.Latency.Events > 0 && e.Latency.P99 < eosP99Goal && e.Latency.Missing == 0)
	}
}

func ratioOf(newer, older float64) float64 {
	if newer <= 0 || older <= 0 {
		return 0
	}
	return newer / older
}

func ratioText(x float64) string {
	if x <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.2fx", x)
}

// orNot is s for a measured figure, else "-".
func orNot(measured bool, s string) string {
	if !measured {
		return "-"
	}
	return s
}

// oneLine is err on one line, cut short: a relay's stderr tail holds many.
func oneLine(err error) string {
	s := strings.Join(strings.Fields(err.Error()), " ")
	if len(s) > 300 {
		s = s[:300] + "..."
	}
	return s
}

// markIf is mark for a figure that may be missing.
func markIf(measured, ok bool) string {
	if !measured {
		return "not measured"
	}
	return mark(ok)
}
