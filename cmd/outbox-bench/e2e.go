package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/amqp"
	"github.com/outboxhq/outbox/brokers/kafka"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
)

// The end-to-end latency rows: producers commit at a fixed rate, the
// `outbox relay` binary publishes to a real broker, and a consumer in a
// process of its own stamps each message as it arrives. Commit and arrival
// are both read from the machine's wall clock, which every process shares.

const consumeCommand = "consume"

// e2eBroker is a broker for the end-to-end rows.
type e2eBroker struct {
	name     string
	relayEnv []string // the binary's broker settings
	consume  []string // the consumer process's arguments
	// publisher is the relay's adapter for the broker, set up as the
	// binary sets it up, for the rows of the broker alone.
	publisher func(ctx context.Context) (core.Publisher, error)
	close     func()
}

func (b *bench) e2eBrokers() ([]e2eBroker, []latencyRow) {
	var out []e2eBroker
	var skipped []latencyRow
	if url := os.Getenv("OUTBOX_TEST_AMQP_URL"); url != "" && url != "none" {
		out = append(out, e2eBroker{name: "RabbitMQ",
			relayEnv: []string{"OUTBOX_BROKER=amqp", "OUTBOX_BROKERS_AMQP_URL=" + url},
			consume:  []string{"-broker", "amqp", "-url", url},
			publisher: func(ctx context.Context) (core.Publisher, error) {
				return amqp.New(ctx, amqp.Config{URL: url}, &brokers.Routing{Fixed: benchTopic}, b.log)
			},
			close: func() {}})
	} else {
		skipped = append(skipped, latencyRow{Path: "RabbitMQ", Note: "not measured: OUTBOX_TEST_AMQP_URL is not set"})
	}
	kf, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(4, benchTopic))
	if err != nil {
		skipped = append(skipped, latencyRow{Path: "Kafka", Note: "not measured: start kfake: " + err.Error()})
	} else {
		addrs := strings.Join(kf.ListenAddrs(), ",")
		out = append(out, e2eBroker{name: "Kafka (kfake)",
			relayEnv: []string{"OUTBOX_BROKER=kafka", "OUTBOX_BROKERS_KAFKA_BROKERS=" + addrs},
			consume:  []string{"-broker", "kafka", "-url", addrs},
			publisher: func(ctx context.Context) (core.Publisher, error) {
				return kafka.New(ctx, kafka.Config{Brokers: kf.ListenAddrs()}, &brokers.Routing{Fixed: benchTopic}, b.log)
			},
			close: kf.Close})
	}
	return out, skipped
}

// e2eRun measures one broker at rate events/s for the latency run's time,
// the relay in table mode or, with logMode, reading a replication slot.
func (b *bench) e2eRun(ctx context.Context, br e2eBroker, rate int, logMode bool) (latencyRow, error) {
	row := latencyRow{Rate: rate, Wakeups: true, Path: br.name}
	relayEnv := append(br.relayEnv, "OUTBOX_ROUTING_TOPIC="+benchTopic)
	if logMode {
		row.Path += ", log mode"
		relayEnv = append(relayEnv, "OUTBOX_RELAY_MODE=log")
	}
	if b.cfg.Outbox == "" {
		row.Note = "not measured: -outbox names no binary"
		return row, nil
	}
	cfg, drop, err := b.schema(ctx, "e2e")
	if err != nil {
		return row, err
	}
	defer drop()
	if logMode {
		if err := b.binaryCommand(ctx, cfg, "slot", "create"); err != nil {
			return row, err
		}
		defer func() {
			if err := b.binaryCommand(context.WithoutCancel(ctx), cfg, "slot", "drop"); err != nil {
				b.log.Warn("drop the latency run's slot", "error", err)
			}
		}()
	}

	rec, stopConsumer, err := startConsumer(ctx, br)
	if err != nil {
		return row, err
	}
	defer stopConsumer()

	relay, err := b.startBinary(ctx, cfg, relayEnv...)
	if err != nil {
		return row, err
	}
	defer func() { _ = relay.stop() }()
	// The binary is ready when its listener is: give it the moment the
	// in-process rows give theirs, then warm-up events through the path.
	time.Sleep(500 * time.Millisecond)
	pool, err := b.producerPool(ctx)
	if err != nil {
		return row, err
	}
	defer pool.Close()
	w, err := outbox.NewWriter(outbox.WriterOptions{Store: cfg})
	if err != nil {
		return row, err
	}
	if err := b.warmUp(ctx, pool, 16, w, rec); err != nil {
		return row, fmt.Errorf("%w:\n%s", err, relay.stderr)
	}
	produce := func(ctx context.Context, i int64) error {
		_, err := b.produceStamped(ctx, pool, w, rec, i)
		return err
	}

	start := time.Now()
	if err := openLoop(ctx, rate, 16, b.cfg.LatencyRun, produce); err != nil {
		return row, err
	}
	last := time.Now()
	waitCount(ctx, func() int64 { c, p := rec.counts(); return p - c }, 0, 5*time.Second)
	if err := relay.failed(); err != nil {
		return row, err
	}
	lat, missing := rec.latencies()
	row.Events, row.Missing = len(lat), missing
	row.P50, row.P99, row.P999, row.Max = percentile(lat, 50), percentile(lat, 99), percentile(lat, 99.9), percentile(lat, 100)
	row.Achieved = float64(len(lat)+missing) / last.Sub(start).Seconds()
	row.Note = "`outbox relay` binary, shipped defaults; a consumer process stamps arrivals"
	if logMode {
		row.Note = "`outbox relay` binary, shipped defaults and relay.mode log; a consumer process stamps arrivals"
	}
	b.log.Info("latency end to end", "path", row.Path, "rate", rate, "p50", row.P50, "p99", row.P99, "max", row.Max, "missing", missing)
	return row, nil
}

// startConsumer starts the consumer process for br and records each
// arrival it reports; stop ends it.
func startConsumer(ctx context.Context, br e2eBroker) (rec *stamps, stop func(), err error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, nil, fmt.Errorf("find own executable: %w", err)
	}
	cctx, cancel := context.WithCancel(ctx)
	cons := exec.CommandContext(cctx, exe, append([]string{consumeCommand}, br.consume...)...)
	cons.Stderr = os.Stderr
	out, err := cons.StdoutPipe()
	if err != nil {
		cancel()
		return nil, nil, fmt.Errorf("consumer stdout: %w", err)
	}
	if err := cons.Start(); err != nil {
		cancel()
		return nil, nil, fmt.Errorf("start consumer: %w", err)
	}
	stop = func() { cancel(); _ = cons.Wait() }
	lines := bufio.NewScanner(out)
	if !lines.Scan() || lines.Text() != "ready" {
		stop()
		return nil, nil, fmt.Errorf("consumer did not get ready: %q %v", lines.Text(), lines.Err())
	}
	rec = newStamps()
	go func() {
		for lines.Scan() {
			uid, at, ok := strings.Cut(lines.Text(), " ")
			if !ok {
				continue
			}
			n, err := strconv.ParseInt(at, 10, 64)
			if err == nil {
				rec.arrive(uid, time.Unix(0, n))
			}
		}
	}()
	return rec, stop, nil
}

// e2eAlone measures the broker without the relay: the relay's own adapter,
// set up as the binary sets it up, publishes events at rate from as many
// goroutines as the binary has lanes, each timed from the publish call to
// the consumer's arrival. It is the broker's share of the rows above.
func (b *bench) e2eAlone(ctx context.Context, br e2eBroker, rate int) (latencyRow, error) {
	row := latencyRow{Rate: rate, Path: br.name + ", broker alone", Alone: true}
	rec, stopConsumer, err := startConsumer(ctx, br)
	if err != nil {
		return row, err
	}
	defer stopConsumer()
	pub, err := br.publisher(ctx)
	if err != nil {
		return row, err
	}
	defer pub.Close()
	lanes := effective(core.Options{}).Lanes
	publish := func(ctx context.Context, i int64) error {
		id, err := uuid.NewV7()
		if err != nil {
			return fmt.Errorf("new event id: %w", err)
		}
		e := core.Event{Seq: i + 1, ID: id.String(), AggregateID: aggregateID(i, b.cfg.Aggregates),
			Type: "bench.event", Payload: []byte(`{"n":1}`), CreatedAt: time.Now()}
		rec.commit(e.ID, time.Now())
		if err := pub.Publish(ctx, &e); err != nil {
			return fmt.Errorf("publish: %w", err)
		}
		return nil
	}
	// Warm: one publish on each goroutine's channel or connection.
	if err := openLoop(ctx, lanes*10, lanes, time.Second/10, publish); err != nil {
		return row, err
	}
	if got := waitCount(ctx, func() int64 { _, p := rec.counts(); return p }, int64(lanes), 30*time.Second); got < int64(lanes) {
		return row, fmt.Errorf("warm up: %d of %d messages arrived within 30s", got, lanes)
	}
	rec.reset()
	start := time.Now()
	if err := openLoop(ctx, rate, lanes, b.cfg.LatencyRun, publish); err != nil {
		return row, err
	}
	last := time.Now()
	waitCount(ctx, func() int64 { c, p := rec.counts(); return p - c }, 0, 5*time.Second)
	lat, missing := rec.latencies()
	row.Events, row.Missing = len(lat), missing
	row.P50, row.P99, row.P999, row.Max = percentile(lat, 50), percentile(lat, 99), percentile(lat, 99.9), percentile(lat, 100)
	row.Achieved = float64(len(lat)+missing) / last.Sub(start).Seconds()
	row.Note = fmt.Sprintf("no relay and no database: the relay's adapter, set up as the binary sets it up, published to directly from %d goroutines (its lanes), timed from the publish call; a consumer process stamps arrivals", lanes)
	b.log.Info("latency, broker alone", "path", row.Path, "rate", rate, "p50", row.P50, "p99", row.P99, "max", row.Max, "missing", missing)
	return row, nil
}

// runConsume is the consumer process: it prints "ready", then one line per
// message, "<event id> <arrival unix nanos>".
func runConsume(args []string) int {
	fs := flag.NewFlagSet(consumeCommand, flag.ExitOnError)
	broker := fs.String("broker", "", "amqp or kafka")
	url := fs.String("url", "", "AMQP URL, or Kafka brokers separated by commas")
	committed := fs.Bool("committed", false, "Kafka: read committed records only (read_committed)")
	_ = fs.Parse(args)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// The bench closes stdin's other end by ending the process; stop on a
	// broken stdout too.
	w := bufio.NewWriterSize(os.Stdout, 64<<10)
	var mu sync.Mutex
	emit := func(uid string, at time.Time) error {
		mu.Lock()
		defer mu.Unlock()
		if _, err := fmt.Fprintf(w, "%s %d\n", uid, at.UnixNano()); err != nil {
			return err
		}
		return w.Flush()
	}
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "consumer:", err); return 1 }
	var err error
	switch *broker {
	case "amqp":
		err = consumeAMQP(ctx, *url, emit)
	case "kafka":
		err = consumeKafka(ctx, strings.Split(*url, ","), *committed, emit)
	default:
		err = fmt.Errorf("-broker %q is not amqp or kafka", *broker)
	}
	if err != nil && !errors.Is(err, io.EOF) {
		return fail(err)
	}
	return 0
}

func ready() { fmt.Println("ready") }

func consumeAMQP(ctx context.Context, url string, emit func(string, time.Time) error) error {
	conn, err := amqp091.Dial(url)
	if err != nil {
		return fmt.Errorf("dial: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("channel: %w", err)
	}
	// Consume the durable queue the relay's adapter declares for the topic,
	// as a service would. A queue of its own beside it would leave that one
	// filling with every run's events, unconsumed: RabbitMQ then confirms
	// publishes behind a growing backlog, which no deployment has. It is
	// emptied first, so each run starts with nothing queued.
	if err := ch.ExchangeDeclare(benchTopic, "topic", true, false, false, false, nil); err != nil {
		return fmt.Errorf("declare exchange: %w", err)
	}
	q, err := ch.QueueDeclare(benchTopic, true, false, false, false, nil)
	if err != nil {
		return fmt.Errorf("declare queue: %w", err)
	}
	if err := ch.QueueBind(q.Name, benchTopic, benchTopic, false, nil); err != nil {
		return fmt.Errorf("bind queue: %w", err)
	}
	if _, err := ch.QueuePurge(q.Name, false); err != nil {
		return fmt.Errorf("empty queue: %w", err)
	}
	msgs, err := ch.Consume(q.Name, "", true, false, false, false, nil)
	if err != nil {
		return fmt.Errorf("consume: %w", err)
	}
	ready()
	for d := range msgs {
		at := time.Now()
		uid, _ := d.Headers[event.HeaderEventID].(string)
		if err := emit(uid, at); err != nil {
			return err
		}
	}
	return nil
}

func consumeKafka(ctx context.Context, brokers []string, committed bool, emit func(string, time.Time) error) error {
	// From the start: the topic is the run's own, and the bench waits for
	// a warm-up event before it measures.
	opts := []kgo.Opt{kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(benchTopic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(time.Second)}
	if committed {
		opts = append(opts, kgo.FetchIsolationLevel(kgo.ReadCommitted()))
	}
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return fmt.Errorf("kafka client: %w", err)
	}
	defer cl.Close()
	if err := cl.Ping(ctx); err != nil {
		return fmt.Errorf("ping kafka: %w", err)
	}
	ready()
	for {
		fs := cl.PollFetches(ctx)
		if fs.IsClientClosed() || ctx.Err() != nil {
			return nil
		}
		at := time.Now()
		var err error
		fs.EachRecord(func(r *kgo.Record) {
			for _, h := range r.Headers {
				if h.Key == event.HeaderEventID && err == nil {
					err = emit(string(h.Value), at)
				}
			}
		})
		if err != nil {
			return err
		}
	}
}
