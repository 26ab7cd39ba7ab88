package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"
)

func main() {
	os.Exit(run())
}

func run() int {
	var (
		events     = flag.Int("events", envInt("OUTBOX_CHAOS_EVENTS", 100000), "committed events per broker (env OUTBOX_CHAOS_EVENTS)")
		relays     = flag.Int("relays", 4, "relay processes, 2 to 4")
		brokerList = flag.String("brokers", "amqp,kafka", "brokers to run against, in order")
		repeat     = flag.Int("repeat", 4, "times each fault kind is applied")
		faultList  = flag.String("faults", strings.Join(AllFaults, ","), "fault kinds")
		rate       = flag.Int("rate", 400, "events per second the producers aim for")
		modeList   = flag.String("modes", "table,log", "relay modes to run each broker with, in order")
		eosList    = flag.String("kafka-paths", "plain,exactly-once", "Kafka publishers to run each mode with, in order: plain, exactly-once (brokers.kafka.exactly_once)")
		verbose    = flag.Bool("v", false, "debug logging, the relays' too")
		dir        = flag.String("dir", "", "keep each run's files (relay logs, server logs) in a new directory under this one")
	)
	flag.Parse()
	level, relayLog := slog.LevelInfo, ""
	if *verbose {
		level, relayLog = slog.LevelDebug, "debug"
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	root, err := ModuleRoot()
	if err != nil {
		log.Error("chaos", "error", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	kinds := strings.Split(*faultList, ",")
	var faults []string
	for range *repeat {
		faults = append(faults, kinds...)
	}
	paths := map[string][]bool{"amqp": {false}}
	for _, p := range strings.Split(*eosList, ",") {
		switch p {
		case "plain":
			paths["kafka"] = append(paths["kafka"], false)
		case "exactly-once":
			paths["kafka"] = append(paths["kafka"], true)
		default:
			log.Error("chaos", "error", fmt.Sprintf("-kafka-paths: %q is not plain or exactly-once", p))
			return 2
		}
	}
	for _, broker := range strings.Split(*brokerList, ",") {
		if paths[broker] == nil {
			log.Error("chaos", "error", fmt.Sprintf("-brokers: %q is not amqp or kafka (or -kafka-paths is empty)", broker))
			return 2
		}
	}
	failed := false
	var kafkaRuns []*Report
	for _, broker := range strings.Split(*brokerList, ",") {
		for _, mode := range strings.Split(*modeList, ",") {
			for _, eos := range paths[broker] {
				// Faults are spread over the production, each taking about 6s.
				produceFor := time.Duration(*events / max(1, *rate) * int(time.Second))
				gap := max(3*time.Second, produceFor/time.Duration(max(1, len(faults)))-6*time.Second)
				rep, err := Run(ctx, Options{
					Root: root, Broker: broker, Mode: mode, ExactlyOnce: eos, Events: *events, Relays: *relays, Producers: 8,
					Aggregates: 2000, ProduceFor: produceFor, Faults: faults, FaultGap: gap,
					DrainTimeout: 5 * time.Minute, Logger: log, Dir: runDir(*dir, broker, mode, eos), RelayLog: relayLog,
				})
				if err != nil {
					log.Error("chaos run failed", "broker", broker, "mode", mode, "exactly_once", eos, "error", err)
					return 2
				}
				fmt.Printf("\n== %s, relay.mode %s, %s ==\n", broker, mode, rep.Publisher())
				rep.Print(os.Stdout)
				if err := rep.Err(); err != nil {
					fmt.Printf("FAILED:\n%v\n", err)
					failed = true
				} else if eos {
					fmt.Println("OK: nothing lost, nothing phantom, no order violation, no duplicate")
				} else {
					fmt.Println("OK: nothing lost, nothing phantom, no order violation, no effect applied twice")
				}
				if broker == "kafka" {
					kafkaRuns = append(kafkaRuns, rep)
				}
			}
		}
	}
	if len(kafkaRuns) > 0 {
		fmt.Println("\n== Kafka: duplicates per fault kind (before dedupe, read_committed consumer), plain and exactly-once ==")
		PrintComparison(os.Stdout, kafkaRuns)
	}
	if failed {
		return 1
	}
	return 0
}

// runDir makes a directory for one run under parent, or returns "" (a
// temporary one, removed after the run) when parent is empty.
func runDir(parent, broker, mode string, exactlyOnce bool) string {
	if parent == "" {
		return ""
	}
	d, err := os.MkdirTemp(parent, fmt.Sprintf("%s-%s-eos%v-", broker, mode, exactlyOnce))
	if err != nil {
		return ""
	}
	return d
}

func envInt(name string, def int) int {
	var n int
	if _, err := fmt.Sscan(os.Getenv(name), &n); err != nil || n <= 0 {
		return def
	}
	return n
}
