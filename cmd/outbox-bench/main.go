// Command outbox-bench measures the relay against the same PostgreSQL it runs
// on: drain throughput next to a bare-SQL floor and Watermill's forwarder,
// commit-to-publish latency, the producer's cost of writing an event,
// broker throughput, and scale (replicas, backlog size, memory). Ratios
// are taken pair by pair within one run, since absolute figures move
// between machines. It prints a table and, with -out, writes a Markdown
// report and an SVG chart generated from the same numbers.
//
// `make bench` runs it against a throwaway server; `make bench-quick` runs
// a small version.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"runtime/pprof"
	"syscall"
	"time"
)

// config holds every size and duration of a run.
type config struct {
	DatabaseURL string
	Quick       bool

	Backlog      int           // drain backlog
	SmallBacklog int           // scale: the small backlog
	BigBacklog   int           // scale: the large backlog
	LargeRows    int           // scale: a backlog of 3 MiB payloads
	ReplicaLoad  int           // scale: backlog shared by replicas
	Aggregates   int           // distinct aggregate ids in generated backlogs
	PayloadBytes int           // size of each generated payload
	BatchSize    int           // relay and floor batch size; 0: the relay's default
	Lanes        int           // relay lanes; 0: the relay's default
	Claimers     int           // relay open claims; 0: the relay's default
	Outbox       string        // the outbox binary, for the rows that run it
	Drainers     string        // drain section: the drainers to run, by key; empty: all
	DrainCap     time.Duration // upper bound on one drain
	Repeat       int           // rounds of the drain and producer comparisons; the best counts
	BigDrainCap  time.Duration // upper bound on the large-backlog drain
	LatencyRun   time.Duration // length of one fixed-rate latency run
	LatencyPaths string        // latency section: entries separated by commas; a path runs when its name holds every word of one; empty: all
	ProducerRun  time.Duration // length of one producer throughput run
	BrokerEvents int           // events per broker run
	EOSBacklog   int           // exactly-once section: the Kafka drain's backlog

	// The steady section.
	SteadyRun     time.Duration // length of one steady-state run
	BaselineRev   string        // the previous release's commit, built for the steady rows; empty or "none": none
	SteadyProfile string        // directory for CPU profiles and SQL costs of this build's steady rows
	SteadyRows    string        // steady section: entries separated by commas; a row runs when its name holds every word of one; empty: all

	Out        string // Markdown report; empty: print only
	Chart      string // SVG chart; default: next to Out
	CPUProfile string
	MemProfile string
	Only       string // run one section: drain, latency, steady, exactly-once, producer, brokers, scale, producers
	Render     string // re-render the report from this JSON file instead of measuring
}

// previousRelease is the commit of the release before this one, which the
// steady-state rows compare against.
const previousRelease = "9d58d77"

func defaults(quick bool) config {
	c := config{
		Backlog: 500_000, SmallBacklog: 10_000, BigBacklog: 5_000_000, ReplicaLoad: 1_000_000, LargeRows: 300,
		Aggregates: 10_000, PayloadBytes: 128,
		DrainCap: 30 * time.Second, BigDrainCap: 60 * time.Second, Repeat: 2,
		LatencyRun: 10 * time.Second, ProducerRun: 5 * time.Second, BrokerEvents: 50_000, EOSBacklog: 100_000,
		SteadyRun: 10 * time.Second, BaselineRev: previousRelease,
	}
	if quick {
		c.Backlog, c.SmallBacklog, c.BigBacklog, c.ReplicaLoad = 20_000, 5_000, 200_000, 20_000
		c.LargeRows = 60
		c.Aggregates = 1000
		c.DrainCap, c.BigDrainCap, c.Repeat = 15*time.Second, 10*time.Second, 1
		c.LatencyRun, c.ProducerRun, c.BrokerEvents = 2*time.Second, 2*time.Second, 5_000
		c.EOSBacklog = 20_000
		c.SteadyRun = 2 * time.Second
	}
	return c
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == childCommand {
		os.Exit(runChild(os.Args[2:]))
	}
	if len(os.Args) > 1 && os.Args[1] == profiledCommand {
		os.Exit(runProfiled(os.Args[2:]))
	}
	if len(os.Args) > 1 && os.Args[1] == consumeCommand {
		os.Exit(runConsume(os.Args[2:]))
	}
	quick := false
	for _, a := range os.Args[1:] {
		if a == "-quick" || a == "--quick" || a == "-quick=true" {
			quick = true
		}
	}
	c := defaults(quick)
	fs := flag.NewFlagSet("bench", flag.ExitOnError)
	fs.BoolVar(&c.Quick, "quick", quick, "small sizes: a run of about two minutes")
	fs.StringVar(&c.DatabaseURL, "database", envURL(), "PostgreSQL URL (default $OUTBOX_TEST_DATABASE_URL or $DATABASE_URL)")
	fs.IntVar(&c.Backlog, "backlog", c.Backlog, "events in the drain backlog")
	fs.IntVar(&c.SmallBacklog, "small-backlog", c.SmallBacklog, "scale: small backlog")
	fs.IntVar(&c.BigBacklog, "big-backlog", c.BigBacklog, "scale: large backlog")
	fs.IntVar(&c.LargeRows, "large-rows", c.LargeRows, "scale: rows of 3 MiB payloads in the large-payload backlog")
	fs.IntVar(&c.ReplicaLoad, "replica-backlog", c.ReplicaLoad, "scale: backlog drained by 1, 2 and 4 replicas")
	fs.IntVar(&c.Aggregates, "aggregates", c.Aggregates, "distinct aggregate ids in generated backlogs")
	fs.IntVar(&c.PayloadBytes, "payload", c.PayloadBytes, "bytes per generated payload")
	fs.IntVar(&c.BatchSize, "batch", c.BatchSize, "library relay and floor batch size (relay option BatchSize; 0: its default)")
	fs.IntVar(&c.Lanes, "lanes", c.Lanes, "library relay option Lanes (0: its default)")
	fs.IntVar(&c.Claimers, "claimers", c.Claimers, "library relay option Claimers (0: its default)")
	fs.StringVar(&c.Outbox, "outbox", "", "the outbox binary (go build ./cmd/outbox) for the rows that run `outbox relay`")
	fs.StringVar(&c.Drainers, "drainers", "", "drain section: run only these, separated by commas: floor, binary-ordered, binary-unordered, binary-log, binary-logonly, library-ordered, library-unordered, watermill-default, watermill-queue")
	fs.DurationVar(&c.DrainCap, "drain-cap", c.DrainCap, "upper bound on one drain; the rate is taken over what drained")
	fs.IntVar(&c.Repeat, "repeat", c.Repeat, "rounds of the drain and producer comparisons, interleaved; each variant's best round counts")
	fs.DurationVar(&c.BigDrainCap, "big-drain-cap", c.BigDrainCap, "upper bound on the large-backlog drain")
	fs.DurationVar(&c.LatencyRun, "latency-run", c.LatencyRun, "length of one fixed-rate latency run")
	fs.StringVar(&c.LatencyPaths, "latency-paths", "", "latency section: run only the paths whose name holds every word of one of these entries, separated by commas (e.g. \"rabbitmq log,in process\")")
	fs.DurationVar(&c.ProducerRun, "producer-run", c.ProducerRun, "length of one producer throughput run")
	fs.IntVar(&c.BrokerEvents, "broker-events", c.BrokerEvents, "events per broker run")
	fs.IntVar(&c.EOSBacklog, "eos-backlog", c.EOSBacklog, "exactly-once section: events in the Kafka drain's backlog, plain and exactly-once")
	fs.DurationVar(&c.SteadyRun, "steady-run", c.SteadyRun, "length of one steady-state run")
	fs.StringVar(&c.BaselineRev, "baseline-rev", c.BaselineRev, "the previous release's commit: its `outbox` binary is built (git archive, go build) and run beside this build's in the steady-state rows; \"none\" skips it")
	fs.StringVar(&c.SteadyRows, "steady-rows", "", "steady section: run only the rows whose name (such as \"cpu-log-only-1relays-1000\" or \"latency-kafka-kfake-3relays-1000\") holds every word of one of these entries, separated by commas (e.g. \"cpu 1000,latency 3relays\")")
	fs.StringVar(&c.SteadyProfile, "steady-profile", "", "steady rows: run this build's relay in this program under a CPU profile, and write profiles and the relay's SQL costs (pg_stat_statements, when loaded) into this directory")
	fs.StringVar(&c.Out, "out", "", "write the Markdown report here")
	fs.StringVar(&c.Chart, "chart", "", "write the SVG chart here (default: beside -out)")
	fs.StringVar(&c.CPUProfile, "cpuprofile", "", "write a CPU profile of the whole run here")
	fs.StringVar(&c.MemProfile, "memprofile", "", "write an allocation profile of the whole run here")
	fs.StringVar(&c.Only, "only", "", "run one section: drain, latency, steady, exactly-once, producer, brokers, scale or producers")
	fs.StringVar(&c.Render, "render", "", "write -out again from the figures saved beside an earlier report (its .json)")
	_ = fs.Parse(os.Args[1:])

	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	if c.Render != "" {
		if err := rerender(c); err != nil {
			log.Error("render failed", "error", err)
			os.Exit(1)
		}
		return
	}
	if c.DatabaseURL == "" {
		log.Error("no database: set OUTBOX_TEST_DATABASE_URL or -database, or run `make bench`")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if c.CPUProfile != "" {
		f, err := os.Create(c.CPUProfile)
		if err != nil {
			log.Error("create profile", "error", err)
			os.Exit(1)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			log.Error("start profile", "error", err)
			os.Exit(1)
		}
		defer func() { pprof.StopCPUProfile(); f.Close() }()
	}
	err := run(ctx, c, log)
	if c.MemProfile != "" {
		if err := writeMemProfile(c.MemProfile); err != nil {
			log.Error("write allocation profile", "error", err)
		}
	}
	if err != nil {
		log.Error("bench failed", "error", err)
		os.Exit(1)
	}
}

func writeMemProfile(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := pprof.Lookup("allocs").WriteTo(f, 0); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func envURL() string {
	if u := os.Getenv("OUTBOX_TEST_DATABASE_URL"); u != "" {
		return u
	}
	return os.Getenv("DATABASE_URL")
}

func run(ctx context.Context, c config, log *slog.Logger) error {
	b, err := newBench(ctx, c, log)
	if err != nil {
		return err
	}
	defer b.close()
	rep := &report{Config: c, Started: time.Now()}
	if rep.Env, err = b.environment(ctx); err != nil {
		return err
	}
	sections := []struct {
		name string
		run  func(context.Context, *report) error
	}{
		{"drain", b.drainSection},
		{"latency", b.latencySection},
		{"steady", b.steadySection},
		{"exactly-once", b.eosSection},
		{"producer", b.producerSection},
		{"brokers", b.brokerSection},
		{"scale", b.scaleSection},
		{"producers", b.producersSection},
	}
	for _, s := range sections {
		if c.Only != "" && c.Only != s.name {
			continue
		}
		start := time.Now()
		log.Info("section", "name", s.name)
		if err := s.run(ctx, rep); err != nil {
			return fmt.Errorf("run %s: %w", s.name, err)
		}
		log.Info("section done", "name", s.name, "took", time.Since(start).Round(time.Second))
	}
	rep.Finished = time.Now()
	rep.evaluate()
	rep.printText(os.Stdout)
	if c.Out != "" {
		if err := rep.write(c.Out, c.Chart); err != nil {
			return err
		}
		log.Info("report written", "path", c.Out)
	}
	return nil
}
