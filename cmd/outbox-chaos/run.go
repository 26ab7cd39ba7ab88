package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/brokers/brokertest"
	"github.com/outboxhq/outbox/dedupe"
	"github.com/outboxhq/outbox/store/logrelay"
	"github.com/outboxhq/outbox/store/migrate"
)

// Fault kinds, in the order a run applies them by default.
const (
	KillRelay   = "kill-relay"       // SIGKILL one relay; it is restarted
	PauseRelay  = "pause-relay"      // SIGSTOP one relay past its claim timeout, then SIGCONT
	RestartMQ   = "restart-broker"   // the broker down a few seconds (RabbitMQ stop_app; Kafka: see AllFaults), then up
	RestartPG   = "restart-pg"       // PostgreSQL fast shutdown, a few seconds down, start
	CrashPG     = "crash-pg"         // PostgreSQL immediate shutdown (crash recovery), start
	KillAll     = "kill-all"         // SIGKILL every relay at once
	FreezeMQ    = "freeze-broker"    // the broker frozen (RabbitMQ: SIGSTOP; Kafka: see AllFaults), then resumed
	BlackHole   = "blackhole-broker" // the relays' broker proxy reads and never answers, then heals
	HalfOpen    = "halfopen-broker"  // the relays' broker proxy reads nothing and answers nothing, then heals
	CutRelayDB  = "cut-relay-db"     // log mode: the slot reader's way to PostgreSQL black-holed, then healed
	KillStorm   = "kill-storm"       // SIGKILL a relay (mid-claim when it can) every stormEvery, stormKills times
	FreezeRelay = "freeze-relay"     // SIGSTOP one relay mid-claim for freezeFor, inside its claim window, then SIGCONT
	topic       = "order"            // where "order.updated" is routed
	claimWindow = 5 * time.Second    // idle_in_transaction_timeout given to the relays
)

// AllFaults are the fault kinds, each for every broker but CutRelayDB, for
// log mode only. Kafka runs on kfake inside this process, in memory, and
// every client reaches it through a proxy: there RestartMQ is the proxy
// resetting every connection and refusing new ones for the outage (the
// broker's side of a restart; its log and transactions survive, as on a
// real broker's disk), and FreezeMQ the proxy stalling every connection,
// as a broker stopped with SIGSTOP does.
var AllFaults = []string{KillRelay, RestartPG, PauseRelay, RestartMQ, CrashPG, KillAll, FreezeMQ, BlackHole, HalfOpen, CutRelayDB, KillStorm, FreezeRelay}

// The kill storm and the short freeze.
const (
	stormEvery = 1500 * time.Millisecond
	stormKills = 6
	freezeFor  = 2 * time.Second
)

// LagSLO is the lag (age of the oldest pending event) a run counts as
// recovered under, after each fault.
const LagSLO = 2 * time.Second

// Options configure a run. The zero value is a short run against RabbitMQ.
type Options struct {
	Root       string        // module root, holding scripts/ and cmd/; required
	Broker     string        // "amqp" (default) or "kafka"
	Events     int           // committed events to produce at least (more while faults last); default 3000
	Relays     int           // relay processes, 2 to 4; default 3
	Producers  int           // producer goroutines; default 4
	Aggregates int           // default 300
	ProduceFor time.Duration // spread production over this; default 25s
	// Faults are applied one after another while producing, FaultGap
	// apart; default AllFaults (less CutRelayDB in table mode).
	Faults   []string
	FaultGap time.Duration // default 2s
	Outage   time.Duration // how long a server stays down; default 3s
	// Stall is how long the broker stays frozen, black-holed or
	// half-open; default 8s, past the relays' heartbeat of 2s times
	// three, so their connections drop while publishes wait.
	Stall time.Duration
	// DrainTimeout bounds the wait, after production and faults, for the
	// backlog to empty and every event to reach the checker; default 3m.
	DrainTimeout time.Duration
	// Mode is the relays' relay.mode: "table" (default) or "log", where
	// they read the rows' inserts from a replication slot, one relay
	// holding it and the others standing by.
	Mode string
	// ExactlyOnce runs the Kafka relays with brokers.kafka.exactly_once:
	// the checker then requires that no event arrives twice.
	ExactlyOnce bool
	// Deadline bounds the run once its binary is built and its servers
	// are up (those can take minutes on a loaded machine, or with an
	// install); default none but ctx's.
	Deadline time.Duration
	Dir      string       // work directory (binary, logs); default a new temporary one
	RelayLog string       // the relays' log.level; default info
	Logger   *slog.Logger // progress; default discard
}

func (o Options) withDefaults() (Options, error) {
	if o.Root == "" {
		return o, errors.New("chaos: Root is required")
	}
	if o.Broker == "" {
		o.Broker = "amqp"
	}
	if o.Broker != "amqp" && o.Broker != "kafka" {
		return o, fmt.Errorf("chaos: broker %q is not amqp or kafka", o.Broker)
	}
	if o.ExactlyOnce && o.Broker != "kafka" {
		return o, fmt.Errorf("chaos: exactly-once is for kafka, not %s", o.Broker)
	}
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	def(&o.Events, 3000)
	def(&o.Relays, 3)
	def(&o.Producers, 4)
	def(&o.Aggregates, 300)
	if o.Mode == "" {
		o.Mode = "table"
	}
	if o.Mode != "table" && o.Mode != "log" {
		return o, fmt.Errorf("chaos: mode %q is not table or log", o.Mode)
	}
	if o.Relays < 2 || o.Relays > 4 {
		return o, fmt.Errorf("chaos: Relays %d is not between 2 and 4", o.Relays)
	}
	if o.Events < 1 || o.Producers < 1 || o.Aggregates < 1 {
		return o, errors.New("chaos: Events, Producers and Aggregates must be positive")
	}
	defDur := func(v *time.Duration, d time.Duration) {
		if *v == 0 {
			*v = d
		}
	}
	defDur(&o.ProduceFor, 25*time.Second)
	defDur(&o.FaultGap, 2*time.Second)
	defDur(&o.Outage, 3*time.Second)
	defDur(&o.Stall, 8*time.Second)
	defDur(&o.DrainTimeout, 3*time.Minute)
	if o.Faults == nil {
		o.Faults = AllFaults
	}
	var faults []string
	for _, f := range o.Faults {
		switch f {
		case KillRelay, PauseRelay, RestartPG, CrashPG, KillAll, BlackHole, HalfOpen, RestartMQ, FreezeMQ, KillStorm, FreezeRelay:
		case CutRelayDB:
			if o.Mode != "log" {
				continue
			}
		default:
			return o, fmt.Errorf("chaos: unknown fault %q", f)
		}
		faults = append(faults, f)
	}
	o.Faults = faults
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return o, nil
}

// Report is the accounting of a run.
type Report struct {
	Broker       string
	Mode         string
	ExactlyOnce  bool
	Relays       int
	Elapsed      time.Duration
	Faults       map[string]int
	MidClaim     int // relay kills and pauses that caught the relay holding a claim
	RelayExits   int // relay processes that ended (killed or failed) and were restarted
	FailedCycles int // "relay cycle failed" log lines, all relays
	// MaxFailedCyclesPerSecond is the most failed cycles one relay logged
	// in one second: a relay that spins instead of backing off shows here.
	MaxFailedCyclesPerSecond int

	Committed           int // rows in the outbox
	RolledBack          int // events written in transactions that rolled back
	Delivered           int // distinct events the checker received
	Receipts            int // messages the checker received
	Lost                int // committed, never delivered
	Phantom             int // delivered, never committed
	RolledBackDelivered int // of those, events of rolled-back transactions
	OrderViolations     int
	Duplicates          int // Receipts - Delivered, before dedupe
	Effects             int // events whose effect was applied
	EffectsTwice        int // effects applied more than once (after dedupe)
	NoIdentity          int // messages without event identity or sequence
	BacklogAtEnd        int
	ProducerRetries     int64
	UncertainCommits    int64 // commits whose acknowledgement was lost
	ConsumerRetries     int64
	ConsumerReconnects  int64
	Examples            []string
	// Recovery is, per fault kind, the time from the fault's end until
	// the lag was back under LagSLO, one entry per fault applied.
	Recovery map[string][]time.Duration
	// Takeover is, in log mode, per relay fault that hit the relay
	// reading the slot, the time from the fault until another walsender
	// read it.
	Takeover map[string][]time.Duration
	// Rate is the events committed per second of production, and
	// FaultDuplicates, per fault kind, the duplicates received from each
	// fault's start until the next one's (the last one's until the end):
	// divided by Rate, the seconds of traffic a fault sent again.
	Rate            float64
	FaultDuplicates map[string][]int
}

// Err says what is wrong with the figures, or nil.
func (r *Report) Err() error {
	var errs []error
	check := func(name string, v, want int) {
		if v != want {
			errs = append(errs, fmt.Errorf("%s: %d, want %d", name, v, want))
		}
	}
	check("lost", r.Lost, 0)
	check("phantom", r.Phantom, 0)
	check("order violations", r.OrderViolations, 0)
	check("effects applied twice", r.EffectsTwice, 0)
	check("events without effect", r.Committed-r.Effects, 0)
	check("messages without identity", r.NoIdentity, 0)
	check("backlog at end", r.BacklogAtEnd, 0)
	if r.ExactlyOnce {
		check("duplicates (exactly-once, read_committed)", r.Duplicates, 0)
	}
	for _, f := range AllFaults {
		for _, d := range r.Recovery[f] {
			if d >= recoveryLimit {
				errs = append(errs, fmt.Errorf("after %s the lag stayed over %s for %s", f, LagSLO, recoveryLimit))
			}
		}
	}
	for _, f := range AllFaults {
		for _, d := range r.Takeover[f] {
			if d >= TakeoverSLO {
				errs = append(errs, fmt.Errorf("after %s no other relay read the slot for %s (bound %s)", f, d.Round(10*time.Millisecond), TakeoverSLO))
			}
		}
	}
	if r.MaxFailedCyclesPerSecond > 20 {
		errs = append(errs, fmt.Errorf("a relay failed %d cycles in one second: it does not back off", r.MaxFailedCyclesPerSecond))
	}
	return errors.Join(errs...)
}

// Print writes the accounting table.
func (r *Report) Print(w io.Writer) {
	var faults []string
	for _, f := range AllFaults {
		if n := r.Faults[f]; n > 0 {
			faults = append(faults, fmt.Sprintf("%s x%d", f, n))
		}
	}
	rows := []struct {
		k string
		v any
	}{
		{"broker", r.Broker},
		{"publisher", r.Publisher()},
		{"relay mode", r.Mode},
		{"relay processes", r.Relays},
		{"elapsed", r.Elapsed.Round(time.Second)},
		{"faults", strings.Join(faults, ", ")},
		{"relay faults mid-claim", r.MidClaim},
		{"relay restarts", r.RelayExits},
		{"events committed", r.Committed},
		{"events rolled back", r.RolledBack},
		{"events delivered (unique)", r.Delivered},
		{"messages received", r.Receipts},
		{"lost", r.Lost},
		{"delivered, never committed", fmt.Sprintf("%d (of rolled-back transactions: %d)", r.Phantom, r.RolledBackDelivered)},
		{"order violations", r.OrderViolations},
		{"duplicates before dedupe", r.Duplicates},
		{"effects applied", r.Effects},
		{"effects applied twice", r.EffectsTwice},
		{"messages without identity", r.NoIdentity},
		{"backlog at end", r.BacklogAtEnd},
		{"failed relay cycles", fmt.Sprintf("%d (at most %d/s in one relay)", r.FailedCycles, r.MaxFailedCyclesPerSecond)},
		{"producer retries", fmt.Sprintf("%d (commits unacknowledged: %d)", r.ProducerRetries, r.UncertainCommits)},
		{"consumer retries", fmt.Sprintf("%d (reconnects: %d)", r.ConsumerRetries, r.ConsumerReconnects)},
	}
	for _, row := range rows {
		fmt.Fprintf(w, "%-28s %v\n", row.k, row.v)
	}
	for _, e := range r.Examples {
		fmt.Fprintf(w, "  %s\n", e)
	}
	fmt.Fprintf(w, "%-28s\n", fmt.Sprintf("recovery (lag under %s after the fault ends):", LagSLO))
	for _, f := range AllFaults {
		if ds := r.Recovery[f]; len(ds) > 0 {
			fmt.Fprintf(w, "  %-26s %s\n", f, summarize(ds))
		}
	}
	if r.Rate > 0 && len(r.FaultDuplicates) > 0 {
		n := 0
		for _, ds := range r.FaultDuplicates {
			n += len(ds)
		}
		fmt.Fprintf(w, "%-28s\n", fmt.Sprintf("duplicates per fault (seconds of traffic at %.0f events/s; all faults: %.2fs):",
			r.Rate, float64(r.Duplicates)/float64(max(1, n))/r.Rate))
		for _, f := range AllFaults {
			if ds := r.FaultDuplicates[f]; len(ds) > 0 {
				fmt.Fprintf(w, "  %-26s %s\n", f, r.trafficSeconds(ds))
			}
		}
	}
	if len(r.Takeover) > 0 {
		fmt.Fprintf(w, "%-28s\n", "takeover (from the fault on the slot's reader to another reading it):")
		for _, f := range AllFaults {
			if ds := r.Takeover[f]; len(ds) > 0 {
				fmt.Fprintf(w, "  %-26s %s\n", f, summarize(ds))
			}
		}
	}
}

// Publisher names the Kafka path a run took, or the broker's only one.
func (r *Report) Publisher() string {
	switch {
	case r.ExactlyOnce:
		return "exactly-once (transactional; consumer read_committed)"
	case r.Broker == "kafka":
		return "plain (consumer read_committed)"
	}
	return "plain"
}

// trafficSeconds gives the largest and the mean of duplicate counts ds in
// seconds of traffic.
func (r *Report) trafficSeconds(ds []int) string {
	sum, top := 0, 0
	for _, d := range ds {
		sum, top = sum+d, max(top, d)
	}
	return fmt.Sprintf("max %.2fs, mean %.2fs (%d duplicates over %d)", float64(top)/r.Rate, float64(sum)/float64(len(ds))/r.Rate, sum, len(ds))
}

// summarize gives the largest and the median of ds.
func summarize(ds []time.Duration) string {
	s := slices.Clone(ds)
	slices.Sort(s)
	return fmt.Sprintf("max %v, median %v (%d)", s[len(s)-1].Round(10*time.Millisecond), s[len(s)/2].Round(10*time.Millisecond), len(s))
}

// Run starts private servers, relays, producers and the checker, applies
// the faults, waits for the backlog to drain and returns the accounting.
func Run(ctx context.Context, opts Options) (*Report, error) {
	o, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	log := o.Logger
	start := time.Now()
	if o.Dir == "" {
		dir, err := os.MkdirTemp("", "outbox-chaos-")
		if err != nil {
			return nil, fmt.Errorf("chaos: %w", err)
		}
		defer os.RemoveAll(dir)
		o.Dir = dir
	}
	// The servers' files must be reachable for the postgres user.
	if err := os.Chmod(o.Dir, 0o755); err != nil {
		return nil, fmt.Errorf("chaos: %w", err)
	}
	log.Info("building cmd/outbox")
	bin, err := BuildRelay(ctx, o.Root, o.Dir, o.Broker)
	if err != nil {
		return nil, err
	}
	log.Info("starting servers")
	srv, err := StartServers(ctx, o.Root, o.Dir, o.Broker == "amqp")
	if err != nil {
		return nil, err
	}
	defer srv.Stop()
	if o.Deadline > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, o.Deadline)
		defer cancel()
	}
	db, err := setupDatabase(ctx, srv.DatabaseURL, o.Aggregates)
	if err != nil {
		return nil, err
	}
	defer db.admin.Close()

	relayEnv := []string{
		"PATH=" + os.Getenv("PATH"), "HOME=" + o.Dir,
		"DATABASE_URL=" + db.relayURL,
		"OUTBOX_BROKER=" + o.Broker,
		"OUTBOX_STORE_SCHEMA=" + schema,
		"OUTBOX_RELAY_BATCH_SIZE=200",
		"OUTBOX_RELAY_PUBLISH_TIMEOUT=2s",
		"OUTBOX_RELAY_POLL_INTERVAL=500ms",
		"OUTBOX_RELAY_SHUTDOWN_TIMEOUT=10s",
		"OUTBOX_DATABASE_IDLE_IN_TRANSACTION_TIMEOUT=" + claimWindow.String(),
		"OUTBOX_LOG_FORMAT=json",
		// Short, so a frozen broker's connections drop within a stall.
		"OUTBOX_BROKERS_AMQP_HEARTBEAT=2s",
		"OUTBOX_RELAY_MODE=" + o.Mode,
		// A paused relay's slot is freed within the claim window.
		"OUTBOX_RELAY_LOG_WAL_SENDER_TIMEOUT=3s",
		"OUTBOX_RELAY_LOG_RECEIVE_TIMEOUT=5s",
		"OUTBOX_RELAY_LOG_STANDBY_INTERVAL=250ms",
	}
	if o.ExactlyOnce {
		relayEnv = append(relayEnv, "OUTBOX_BROKERS_KAFKA_EXACTLY_ONCE=true")
	}
	if o.RelayLog != "" {
		relayEnv = append(relayEnv, "OUTBOX_LOG_LEVEL="+o.RelayLog)
	}
	if o.Mode == "log" {
		// As an operator would: the relays' role may read slots, and the
		// slot and publication exist before they start.
		if _, err := db.admin.Exec(ctx, "ALTER ROLE "+relayRole+" REPLICATION"); err != nil {
			return nil, fmt.Errorf("chaos: %w", err)
		}
		if err := migrate.ApplyGrants(ctx, db.admin, db.cfg, migrate.Roles{Relay: relayRole, LogMode: true}); err != nil {
			return nil, fmt.Errorf("chaos: %w", err)
		}
		if _, err := logrelay.CreateSlot(ctx, db.admin, db.cfg, logrelay.Slot{}); err != nil {
			return nil, fmt.Errorf("chaos: %w", err)
		}
	}
	chk := &checker{t: newTally(), log: log.With("part", "checker")}
	consumerPool, err := pool(ctx, db.consumerURL, 4)
	if err != nil {
		return nil, err
	}
	defer consumerPool.Close()
	if chk.d, err = dedupe.New(consumerPool, dedupe.Options{Consumer: "chaos-checker", Store: db.cfg}); err != nil {
		return nil, err
	}
	cctx, stopConsumer := context.WithCancel(ctx)
	var consumerDone sync.WaitGroup
	defer func() { stopConsumer(); consumerDone.Wait() }()

	var proxy *brokertest.Proxy
	switch o.Broker {
	case "amqp":
		// The relays reach RabbitMQ through a proxy the faults can
		// black-hole; the checker goes direct.
		u, err := url.Parse(srv.AMQPURL)
		if err != nil {
			return nil, fmt.Errorf("chaos: amqp url: %w", err)
		}
		if proxy, err = brokertest.Listen(u.Host); err != nil {
			return nil, fmt.Errorf("chaos: broker proxy: %w", err)
		}
		defer proxy.Cut()
		u.Host = proxy.Addr()
		relayEnv = append(relayEnv, "OUTBOX_BROKERS_AMQP_URL="+u.String())
		if err := prepareQueue(srv.AMQPURL); err != nil {
			return nil, err
		}
		consumerDone.Add(1)
		go func() { defer consumerDone.Done(); chk.consumeAMQP(cctx, srv.AMQPURL, topic) }()
	case "kafka":
		// kfake advertises the proxy's address, so every connection to
		// it, the relays' and the checker's, goes through the proxy.
		cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(8, topic),
			kfake.ListenFn(func(network, addr string) (net.Listener, error) {
				ln, err := net.Listen(network, addr)
				if err != nil {
					return nil, err
				}
				if proxy, err = brokertest.Listen(ln.Addr().String()); err != nil {
					_ = ln.Close()
					return nil, err
				}
				return proxy.Advertise(ln), nil
			}))
		if err != nil {
			return nil, fmt.Errorf("start kfake: %w", err)
		}
		defer cluster.Close()
		defer proxy.Cut()
		addrs := cluster.ListenAddrs()
		relayEnv = append(relayEnv, "OUTBOX_BROKERS_KAFKA_BROKERS="+strings.Join(addrs, ","))
		consumerDone.Add(1)
		go func() {
			defer consumerDone.Done()
			if err := chk.consumeKafka(cctx, addrs, topic); err != nil {
				log.Error("kafka consumer stopped", "error", err)
			}
		}()
	}

	rctx, stopRelays := context.WithCancel(ctx)
	var relaysDone sync.WaitGroup
	defer func() { stopRelays(); relaysDone.Wait() }()
	slots := make([]*relaySlot, o.Relays)
	for i := range slots {
		slots[i] = newRelaySlot(i, bin, o.Dir, relayEnv, log)
		if o.Mode == "log" {
			// Each relay reaches PostgreSQL through a proxy of its own,
			// so the network of the slot's reader alone can be cut.
			if err := slots[i].proxyDatabase(db.relayURL); err != nil {
				return nil, err
			}
			defer slots[i].db.Cut()
		}
		relaysDone.Add(1)
		go func() { defer relaysDone.Done(); slots[i].supervise(rctx) }()
	}

	producerPool, err := pool(ctx, db.producerURL, int32(o.Producers+2))
	if err != nil {
		return nil, err
	}
	defer producerPool.Close()
	w, err := outbox.NewWriter(outbox.WriterOptions{Store: db.cfg})
	if err != nil {
		return nil, err
	}
	// Transactions average two events; a tenth roll back.
	txs := float64(o.Events) / 2 / 0.9
	prod := &producers{
		pool: producerPool, w: w, aggregates: db.aggregates, target: int64(o.Events), rollback: 0.1,
		interval: time.Duration(float64(o.ProduceFor) * float64(o.Producers) / txs),
		log:      log.With("part", "producer"),
		stats:    &producerStats{rolledBackUIDs: map[string]bool{}},
	}
	log.Info("producing", "events", o.Events, "over", o.ProduceFor, "relays", o.Relays, "broker", o.Broker, "exactly_once", o.ExactlyOnce)
	// Production goes on until the faults are over, so every fault
	// meets producers writing.
	var faultsOver atomic.Bool
	prod.more = func() bool { return !faultsOver.Load() }
	pctx, stopProducers := context.WithCancel(ctx)
	defer stopProducers()
	produceStart := time.Now()
	produced := make(chan struct{})
	go func() { defer close(produced); prod.run(pctx, o.Producers) }()

	progressDone := make(chan struct{})
	go func() { defer close(progressDone); progress(pctx, log, db, prod, chk) }()
	defer func() { stopProducers(); <-progressDone }()

	f := &faulter{prod: prod, db: db, srv: srv, slots: slots, outage: o.Outage, stall: o.Stall, proxy: proxy, broker: o.Broker,
		log: log.With("part", "faults"), done: map[string]int{}, recovery: map[string][]time.Duration{},
		takeover: map[string][]time.Duration{}, dups: chk.t.duplicates, faultDups: map[string][]int{}}
	if o.Mode == "log" {
		sl, err := logrelay.Slot{}.Resolve(ctx, db.admin, db.cfg)
		if err != nil {
			return nil, fmt.Errorf("chaos: %w", err)
		}
		f.slot = sl.Name
	}
	err = f.apply(ctx, o.Faults, o.FaultGap)
	faultsOver.Store(true)
	if err != nil {
		return nil, err
	}
	select {
	case <-produced:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	log.Info("produced; draining", "committed", prod.stats.committed.Load())
	producing := time.Since(produceStart)

	// Drained: nothing pending and every committed event seen.
	deadline := time.Now().Add(o.DrainTimeout)
	backlog := -1
	for {
		committed, err1 := db.committedCount(ctx)
		b, err2 := db.backlog(ctx)
		if err1 == nil && err2 == nil {
			backlog = b
			if b == 0 && chk.t.unique() >= committed {
				break
			}
		}
		if time.Now().After(deadline) {
			log.Warn("drain timed out", "backlog", backlog, "delivered", chk.t.unique(), "committed", committed)
			break
		}
		if !sleep(ctx, 250*time.Millisecond) {
			return nil, ctx.Err()
		}
	}
	// Let late redeliveries in, so duplicates are counted, then stop.
	sleep(ctx, time.Second)
	f.endWindow()
	stopRelays()
	relaysDone.Wait()
	stopConsumer()
	consumerDone.Wait()

	rep := &Report{Broker: o.Broker, Mode: o.Mode, ExactlyOnce: o.ExactlyOnce, Relays: o.Relays, Faults: f.done, MidClaim: f.midClaim, BacklogAtEnd: backlog,
		Recovery: f.recovery, Takeover: f.takeover, FaultDuplicates: f.faultDups}
	for _, s := range slots {
		rep.RelayExits += s.exitCount()
		rep.FailedCycles += s.lines.failureCount()
		rep.MaxFailedCyclesPerSecond = max(rep.MaxFailedCyclesPerSecond, s.lines.maxPerSecond())
	}
	committed, err := db.committedUIDs(ctx)
	if err != nil {
		return nil, err
	}
	rep.Committed = len(committed)
	rep.Rate = float64(rep.Committed) / producing.Seconds()
	rep.RolledBack = int(prod.stats.rolledBack.Load())
	rep.ProducerRetries = prod.stats.retries.Load()
	rep.UncertainCommits = prod.stats.uncertain.Load()
	rep.ConsumerRetries = chk.retries.Load()
	rep.ConsumerReconnects = chk.reconnects.Load()
	chk.t.account(rep, committed, prod.stats.rolledBackUIDs)
	if rep.Effects, rep.EffectsTwice, err = db.effects(ctx); err != nil {
		return nil, fmt.Errorf("count effects: %w", err)
	}
	if b, err := db.backlog(ctx); err == nil {
		rep.BacklogAtEnd = b
	}
	rep.Elapsed = time.Since(start)
	return rep, nil
}

// progress logs the run's figures every 15 seconds until ctx ends.
func progress(ctx context.Context, log *slog.Logger, db *database, prod *producers, chk *checker) {
	for sleep(ctx, 15*time.Second) {
		backlog, _ := db.backlog(ctx)
		log.Info("progress", "committed", prod.stats.committed.Load()+prod.stats.burst.Load(),
			"delivered", chk.t.unique(), "backlog", backlog)
	}
}

func pool(ctx context.Context, url string, conns int32) (*pgxpool.Pool, error) {
	pc, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("parse database URL: %w", err)
	}
	pc.MaxConns = conns
	p, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("connect as %s: %w", pc.ConnConfig.User, err)
	}
	return p, nil
}

// prepareQueue declares the checker's queue before any event is
// published, so nothing goes to an exchange without a queue.
func prepareQueue(url string) error {
	conn, err := amqp091.Dial(url)
	if err != nil {
		return fmt.Errorf("connect to RabbitMQ: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	return declareQueue(ch, topic)
}

// faulter applies faults, counts them and times the recovery from each.
type faulter struct {
	prod          *producers
	db            *database
	midClaim      int // relay faults that caught the relay holding a claim
	srv           *Servers
	slots         []*relaySlot
	outage, stall time.Duration
	proxy         *brokertest.Proxy // between the relays and the broker
	broker        string
	log           *slog.Logger
	done          map[string]int
	recovery      map[string][]time.Duration
	// In log mode: the slot's name, the takeovers being timed, and those
	// timed.
	slot     string
	pending  []pendingTakeover
	takeover map[string][]time.Duration
	// dups counts the checker's duplicates so far; faultDups are those of
	// each fault's window (see Report.FaultDuplicates), the last one's
	// window still open at window.
	dups      func() int
	faultDups map[string][]int
	window    struct {
		kind string
		from int
	}
}

// endWindow closes the duplicates window of the last fault applied.
func (f *faulter) endWindow() {
	if f.window.kind != "" {
		f.faultDups[f.window.kind] = append(f.faultDups[f.window.kind], f.dups()-f.window.from)
		f.window.kind = ""
	}
}

// recoveryLimit bounds the wait for the lag to come back under LagSLO.
const recoveryLimit = 90 * time.Second

func (f *faulter) apply(ctx context.Context, faults []string, gap time.Duration) error {
	for _, kind := range faults {
		if !sleep(ctx, gap) {
			return ctx.Err()
		}
		f.log.Info("fault", "kind", kind)
		f.endWindow()
		f.window.kind, f.window.from = kind, f.dups()
		if err := f.one(ctx, kind); err != nil {
			return fmt.Errorf("fault %s: %w", kind, err)
		}
		f.done[kind]++
		// The next fault waits for this one's recovery, so each is timed
		// on its own.
		d, err := f.recovered(ctx)
		if err != nil {
			return err
		}
		f.log.Info("recovered", "kind", kind, "after", d.Round(100*time.Millisecond))
		f.recovery[kind] = append(f.recovery[kind], d)
		f.takeovers()
	}
	return nil
}

// recovered says how long after the fault's end the lag came back under
// LagSLO to stay: under it for settleWindow without a break (a killed
// relay's lag builds only after the kill, so the first reading alone
// would say 0). A lag still over it after recoveryLimit counts as the
// limit.
func (f *faulter) recovered(ctx context.Context) (time.Duration, error) {
	start := time.Now()
	var under time.Time // since when the lag has been under LagSLO; zero while over
	for {
		lag, err := f.db.lag(ctx)
		switch {
		case err != nil || lag >= LagSLO:
			under = time.Time{}
		case under.IsZero():
			under = time.Now()
		case time.Since(under) >= settleWindow:
			return under.Sub(start), nil
		}
		if time.Since(start) > recoveryLimit {
			return recoveryLimit, nil
		}
		if !sleep(ctx, 100*time.Millisecond) {
			return 0, ctx.Err()
		}
	}
}

// settleWindow is how long the lag must stay under LagSLO to count as
// recovered.
const settleWindow = 3 * time.Second

func (f *faulter) one(ctx context.Context, kind string) error {
	switch kind {
	case KillRelay:
		f.burst(ctx)
		if s, pid := f.target(ctx); s != nil {
			f.stopMidClaim(ctx, s)
			if s.signal(syscall.SIGKILL) && pid != 0 {
				f.watchTakeover(ctx, kind, time.Now(), pid)
			}
		}
	case KillAll:
		var pid int32
		if f.slot != "" {
			_, pid, _ = f.slotHolder(ctx)
		}
		for _, s := range f.slots {
			s.signal(syscall.SIGKILL)
		}
		if pid != 0 {
			f.watchTakeover(ctx, kind, time.Now(), pid)
		}
	case PauseRelay:
		f.burst(ctx)
		s, pid := f.target(ctx)
		if s == nil || !f.stopMidClaim(ctx, s) {
			return nil
		}
		stopped := time.Now()
		if pid != 0 {
			f.watchTakeover(ctx, kind, stopped, pid)
		}
		// Past the claim window, PostgreSQL ends the paused relay's
		// transaction and the others take its events over; in log mode
		// a standby takes the slot over.
		sleep(ctx, time.Until(stopped.Add(claimWindow+3*time.Second)))
		s.signal(syscall.SIGCONT)
	case FreezeMQ:
		if f.broker == "kafka" {
			f.proxy.SetMode(brokertest.Stall)
			sleep(ctx, f.stall)
			f.proxy.Heal()
			return nil
		}
		return f.srv.FreezeRabbitMQ(ctx, f.stall)
	case KillStorm:
		for i := range stormKills {
			if i > 0 && !sleep(ctx, stormEvery) {
				return nil
			}
			// In log mode the slot's reader, when one reads it.
			s := f.runningSlot()
			if f.slot != "" {
				if h, _, err := f.slotHolder(ctx); err == nil && h != nil && h.running() {
					s = h
				}
			}
			if s != nil {
				f.stopMidClaim(ctx, s)
				s.signal(syscall.SIGKILL)
			}
		}
	case FreezeRelay:
		f.burst(ctx)
		s, _ := f.target(ctx)
		if s == nil || !f.stopMidClaim(ctx, s) {
			return nil
		}
		sleep(ctx, freezeFor)
		s.signal(syscall.SIGCONT)
	case CutRelayDB:
		s, pid := f.target(ctx)
		if s == nil || s.db == nil {
			return nil
		}
		s.db.SetMode(brokertest.BlackHole)
		if pid != 0 {
			f.watchTakeover(ctx, kind, time.Now(), pid)
		}
		sleep(ctx, f.stall)
		s.db.Heal()
	case BlackHole, HalfOpen:
		mode := brokertest.BlackHole
		if kind == HalfOpen {
			mode = brokertest.HalfOpen
		}
		f.proxy.SetMode(mode)
		sleep(ctx, f.stall)
		f.proxy.Heal()
	case RestartMQ:
		if f.broker == "kafka" {
			f.proxy.SetMode(brokertest.Down)
			sleep(ctx, f.outage)
			f.proxy.Heal()
			return nil
		}
		if err := f.srv.StopRabbitMQ(); err != nil {
			return err
		}
		sleep(ctx, f.outage)
		return f.srv.StartRabbitMQ()
	case RestartPG, CrashPG:
		mode := "fast"
		if kind == CrashPG {
			mode = "immediate"
		}
		if err := f.srv.StopPostgres(mode); err != nil {
			return err
		}
		sleep(ctx, f.outage)
		return f.srv.StartPostgres()
	}
	return nil
}

// burst writes long runs of events for a few aggregates, so that a relay
// fault that follows finds the relays in the middle of batches.
func (f *faulter) burst(ctx context.Context) {
	if err := f.prod.burst(ctx, 4, 120); err != nil {
		f.log.Warn("burst of events failed", "error", err)
	}
}

// stopMidClaim stops s (SIGSTOP) at a moment it holds a claim, so the
// fault that follows interrupts a batch: it stops it, looks for an open
// transaction on one of its database connections, and if there is none
// lets it run a little and tries again. It returns whether s is left
// stopped, mid-claim or not.
func (f *faulter) stopMidClaim(ctx context.Context, s *relaySlot) bool {
	for range 60 {
		if !s.signal(syscall.SIGSTOP) {
			return false
		}
		var open int
		ports, err := s.clientPorts()
		if err == nil {
			err = f.db.admin.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
WHERE usename = $1 AND client_port = ANY($2) AND xact_start IS NOT NULL AND state <> 'idle'`, relayRole, ports).Scan(&open)
		}
		if err == nil && open > 0 {
			f.log.Debug("relay stopped in a claim", "relay", s.id)
			f.midClaim++
			return true
		}
		s.signal(syscall.SIGCONT)
		sleep(ctx, time.Duration(20+rand.N(100))*time.Millisecond)
	}
	return s.signal(syscall.SIGSTOP)
}

// target picks the relay a relay fault hits: in log mode the one reading
// the slot, with its walsender's pid, so the fault tests a takeover; else,
// or when none reads it within holderWait (relays still starting, or
// standing by after the last fault), a running one at random and pid 0.
func (f *faulter) target(ctx context.Context) (*relaySlot, int32) {
	if f.slot != "" {
		for start := time.Now(); time.Since(start) < holderWait; {
			if s, pid, err := f.slotHolder(ctx); err == nil && s != nil && s.running() {
				return s, pid
			}
			if !sleep(ctx, 50*time.Millisecond) {
				break
			}
		}
	}
	return f.runningSlot(), 0
}

// holderWait bounds how long a relay fault in log mode waits for a relay
// to read the slot.
const holderWait = 5 * time.Second

// runningSlot picks a relay whose process is up, at random.
func (f *faulter) runningSlot() *relaySlot {
	var up []*relaySlot
	for _, s := range f.slots {
		if s.running() {
			up = append(up, s)
		}
	}
	if len(up) == 0 {
		return nil
	}
	return up[rand.N(len(up))]
}

// ModuleRoot finds the directory holding go.mod from the working directory.
func ModuleRoot() (string, error) {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("find module root: %w", err)
	}
	mod := strings.TrimSpace(string(out))
	if mod == "" || mod == os.DevNull {
		return "", errors.New("find module root: not inside a module")
	}
	return filepath.Dir(mod), nil
}
