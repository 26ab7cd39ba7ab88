package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"runtime/metrics"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store"
	tablesrc "github.com/outboxhq/outbox/store/table"
)

func (b *bench) scaleSection(ctx context.Context, rep *report) error {
	for _, k := range []int{1, 2, 4} {
		cfg, drop, err := b.schema(ctx, "replicas")
		if err != nil {
			return err
		}
		err = b.fill(ctx, cfg, b.cfg.ReplicaLoad)
		if err == nil {
			b.settle(ctx)
			var res drainResult
			res, err = b.relayDrain(ctx, fmt.Sprint(k), cfg, b.cfg.ReplicaLoad, b.relayOptions(false, nil), k, b.cfg.DrainCap)
			rep.Replicas = append(rep.Replicas, res.rate)
		}
		drop()
		if err != nil {
			return err
		}
	}
	// The last run holds large payloads, near the relay's default
	// store.max_event_bytes: memory must follow the claim's byte bound,
	// not the backlog.
	for _, r := range []struct{ n, payload int }{
		{b.cfg.SmallBacklog, b.cfg.PayloadBytes}, {b.cfg.BigBacklog, b.cfg.PayloadBytes}, {b.cfg.LargeRows, 3 << 20},
	} {
		row, err := b.backlogRun(ctx, r.n, r.payload)
		if err != nil {
			return fmt.Errorf("backlog of %d: %w", r.n, err)
		}
		rep.Backlogs = append(rep.Backlogs, row)
	}
	return nil
}

// backlogRun explains the store's claim over a backlog of n, then drains it
// with a relay in a process of its own so its memory is the relay's alone.
func (b *bench) backlogRun(ctx context.Context, n, payload int) (backlogRow, error) {
	cfg, drop, err := b.schema(ctx, "backlog")
	if err != nil {
		return backlogRow{}, err
	}
	defer drop()
	if err := b.fillSized(ctx, cfg, n, payload); err != nil {
		return backlogRow{}, err
	}
	b.settle(ctx)
	ms, err := b.explainClaim(ctx, cfg)
	if err != nil {
		return backlogRow{}, err
	}
	limit := b.cfg.DrainCap
	if n > b.cfg.Backlog {
		limit = b.cfg.BigDrainCap
	}
	exe, err := os.Executable()
	if err != nil {
		return backlogRow{}, fmt.Errorf("find own executable: %w", err)
	}
	cmd := exec.CommandContext(ctx, exe, childCommand,
		"-database", b.cfg.DatabaseURL, "-schema", cfg.Schema, "-events", strconv.Itoa(n),
		"-limit", limit.String(), "-batch", strconv.Itoa(b.cfg.BatchSize), "-lanes", strconv.Itoa(b.cfg.Lanes), "-claimers", strconv.Itoa(b.cfg.Claimers))
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		return backlogRow{}, fmt.Errorf("run relay process: %w", err)
	}
	var cr childResult
	if err := json.Unmarshal(bytes.TrimSpace(out), &cr); err != nil {
		return backlogRow{}, fmt.Errorf("read relay process result %q: %w", out, err)
	}
	row := backlogRow{Backlog: n, PayloadBytes: payload, ExplainMs: ms,
		Drained:  rate{Name: count(n), Events: cr.Events, Elapsed: time.Duration(cr.ElapsedNs)},
		ClaimP50: time.Duration(cr.ClaimP50Ns), ClaimP99: time.Duration(cr.ClaimP99Ns),
		PeakHeapMiB: float64(cr.PeakHeapBytes) / (1 << 20), PeakRSSMiB: float64(cr.PeakRSSKiB) / 1024}
	b.log.Info("backlog drained", "backlog", n, "events", cr.Events, "claim_p50", row.ClaimP50, "explain_ms", ms,
		"heap_mib", int(row.PeakHeapMiB), "rss_mib", int(row.PeakRSSMiB))
	return row, nil
}

var execTime = regexp.MustCompile(`Execution Time: ([0-9.]+) ms`)

// explainClaim runs EXPLAIN ANALYZE of exactly the SQL the store sends for
// an ordered claim, captured from the wire, in a transaction rolled back.
func (b *bench) explainClaim(ctx context.Context, cfg store.Config) (float64, error) {
	recorder := &sqlRecorder{}
	pool, err := openPool(ctx, b.cfg.DatabaseURL, 2, recorder)
	if err != nil {
		return 0, err
	}
	defer pool.Close()
	st, err := tablesrc.New(pool, cfg, b.log)
	if err != nil {
		return 0, fmt.Errorf("new store: %w", err)
	}
	c, err := st.Claim(ctx, core.ClaimOptions{Limit: b.batchSize()})
	if err != nil {
		return 0, fmt.Errorf("claim: %w", err)
	}
	if err := c.Release(ctx); err != nil {
		return 0, fmt.Errorf("release: %w", err)
	}
	q, args := recorder.find("SKIP LOCKED")
	if q == "" {
		return 0, fmt.Errorf("claim statement not seen")
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("begin explain: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	// As the store plans it: it sends this setting in the same batch.
	if _, err := tx.Exec(ctx, "SET LOCAL enable_nestloop = off"); err != nil {
		return 0, fmt.Errorf("explain claim: %w", err)
	}
	rows, err := tx.Query(ctx, "EXPLAIN (ANALYZE, BUFFERS) "+q, args...)
	if err != nil {
		return 0, fmt.Errorf("explain claim: %w", err)
	}
	var plan strings.Builder
	for rows.Next() {
		var line string
		if err := rows.Scan(&line); err != nil {
			rows.Close()
			return 0, fmt.Errorf("read plan: %w", err)
		}
		plan.WriteString(line + "\n")
	}
	if err := rows.Err(); err != nil {
		return 0, fmt.Errorf("explain claim: %w", err)
	}
	m := execTime.FindStringSubmatch(plan.String())
	if m == nil {
		return 0, fmt.Errorf("no execution time in plan:\n%s", plan.String())
	}
	b.log.Debug("claim plan", "plan", plan.String())
	return strconv.ParseFloat(m[1], 64)
}

const childCommand = "relay-process"

type childResult struct {
	Events        int64 `json:"events"`
	ElapsedNs     int64 `json:"elapsed_ns"`
	ClaimP50Ns    int64 `json:"claim_p50_ns"`
	ClaimP99Ns    int64 `json:"claim_p99_ns"`
	PeakHeapBytes uint64
	PeakRSSKiB    int64
}

// runChild is the relay process of backlogRun: it drains one schema and
// prints a childResult as JSON.
func runChild(args []string) int {
	fs := flag.NewFlagSet(childCommand, flag.ExitOnError)
	url := fs.String("database", "", "PostgreSQL URL")
	schema := fs.String("schema", "", "outbox schema")
	events := fs.Int("events", 0, "events to drain")
	limit := fs.Duration("limit", time.Minute, "upper bound on the drain")
	batch := fs.Int("batch", 0, "relay BatchSize")
	lanes := fs.Int("lanes", 0, "relay Lanes")
	claimers := fs.Int("claimers", 0, "relay Claimers")
	_ = fs.Parse(args)
	ctx := context.Background()
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "relay process:", err); return 1 }

	var peak atomic.Uint64
	stopSampling := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		s := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
		t := time.NewTicker(10 * time.Millisecond)
		defer t.Stop()
		for {
			metrics.Read(s)
			if v := s[0].Value.Uint64(); v > peak.Load() {
				peak.Store(v)
			}
			select {
			case <-stopSampling:
				return
			case <-t.C:
			}
		}
	}()

	pool, err := openPool(ctx, *url, 4, nil)
	if err != nil {
		return fail(err)
	}
	defer pool.Close()
	st, err := tablesrc.New(pool, store.Config{Schema: *schema, NotifyChannel: *schema}, nil)
	if err != nil {
		return fail(err)
	}
	obs := &drainObserver{}
	relay, err := core.New(st, &counter{}, core.Options{BatchSize: *batch, Lanes: *lanes, Claimers: *claimers, Observer: obs})
	if err != nil {
		return fail(err)
	}
	start := time.Now()
	if err := relay.Start(ctx); err != nil {
		return fail(err)
	}
	got := waitCount(ctx, obs.done.Load, int64(*events), *limit)
	elapsed := time.Since(start)
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := relay.Stop(sctx); err != nil {
		return fail(err)
	}
	close(stopSampling)
	<-sampled
	claims := obs.claimTimes()
	res := childResult{Events: got, ElapsedNs: int64(elapsed),
		ClaimP50Ns: int64(percentile(claims, 50)), ClaimP99Ns: int64(percentile(claims, 99)),
		PeakHeapBytes: peak.Load(), PeakRSSKiB: peakRSS()}
	if err := json.NewEncoder(os.Stdout).Encode(res); err != nil {
		return fail(err)
	}
	return 0
}

// peakRSS reads the process's resident-set high-water mark, in KiB.
func peakRSS() int64 {
	v := procField("/proc/self/status", "VmHWM")
	n, _ := strconv.ParseInt(strings.TrimSuffix(v, " kB"), 10, 64)
	return n
}
