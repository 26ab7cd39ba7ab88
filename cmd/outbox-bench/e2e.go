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
	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/core"
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
	close    func()
}

func (b *bench) e2eBrokers() ([]e2eBroker, []latencyRow) {
	var out []e2eBroker
	var skipped []latencyRow
	if url := os.Getenv("OUTBOX_TEST_AMQP_URL"); url != "" && url != "none" {
		out = append(out, e2eBroker{name: "RabbitMQ",
			relayEnv: []string{"OUTBOX_BROKER=amqp", "OUTBOX_BROKERS_AMQP_URL=" + url},
			consume:  []string{"-broker", "amqp", "-url", url},
			close:    func() {}})
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
			close:    kf.Close})
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

	exe, err := os.Executable()
	if err != nil {
		return row, fmt.Errorf("find own executable: %w", err)
	}
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	cons := exec.CommandContext(cctx, exe, append([]string{consumeCommand}, br.consume...)...)
	cons.Stderr = os.Stderr
	out, err := cons.StdoutPipe()
	if err != nil {
		return row, fmt.Errorf("consumer stdout: %w", err)
	}
	if err := cons.Start(); err != nil {
		return row, fmt.Errorf("start consumer: %w", err)
	}
	defer func() { cancel(); _ = cons.Wait() }()
	lines := bufio.NewScanner(out)
	if !lines.Scan() || lines.Text() != "ready" {
		return row, fmt.Errorf("consumer did not get ready: %q %v", lines.Text(), lines.Err())
	}
	rec := newStamps()
	readDone := make(chan struct{})
	go func() {
		defer close(readDone)
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

	relay, err := b.startBinary(ctx, cfg, relayEnv...)
	if err != nil {
		return row, err
	}
	defer func() { _ = relay.stop() }()
	// The binary is ready when its listener is: give it the moment the
	// in-process rows give theirs, then a warm-up event through the path.
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
	produce := func(ctx context.Context, i int64) error {
		id, err := uuid.NewV7()
		if err != nil {
			return fmt.Errorf("new event id: %w", err)
		}
		uid := id.String()
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			return w.Write(ctx, tx, outbox.Message{ID: uid, AggregateID: aggregateID(i, b.cfg.Aggregates),
				Type: "bench.event", Payload: []byte(`{"n":1}`)})
		}); err != nil {
			return fmt.Errorf("produce: %w", err)
		}
		rec.commit(uid, time.Now())
		return nil
	}
	if err := produce(ctx, 0); err != nil {
		return row, err
	}
	if got := waitCount(ctx, func() int64 { _, p := rec.counts(); return p }, 1, 30*time.Second); got < 1 {
		return row, fmt.Errorf("the warm-up event did not reach the consumer within 30s:\n%s", relay.stderr)
	}
	rec.reset()

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

// runConsume is the consumer process: it prints "ready", then one line per
// message, "<event id> <arrival unix nanos>".
func runConsume(args []string) int {
	fs := flag.NewFlagSet(consumeCommand, flag.ExitOnError)
	broker := fs.String("broker", "", "amqp or kafka")
	url := fs.String("url", "", "AMQP URL, or Kafka brokers separated by commas")
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
		err = consumeKafka(ctx, strings.Split(*url, ","), emit)
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
	// The relay declares the exchange on first publish; declaring it here
	// too (the same way) lets the queue be bound before.
	if err := ch.ExchangeDeclare(benchTopic, "topic", true, false, false, false, nil); err != nil {
		return fmt.Errorf("declare exchange: %w", err)
	}
	q, err := ch.QueueDeclare("", false, true, true, false, nil)
	if err != nil {
		return fmt.Errorf("declare queue: %w", err)
	}
	if err := ch.QueueBind(q.Name, "#", benchTopic, false, nil); err != nil {
		return fmt.Errorf("bind queue: %w", err)
	}
	msgs, err := ch.Consume(q.Name, "", true, true, false, false, nil)
	if err != nil {
		return fmt.Errorf("consume: %w", err)
	}
	ready()
	for d := range msgs {
		at := time.Now()
		uid, _ := d.Headers[core.HeaderEventID].(string)
		if err := emit(uid, at); err != nil {
			return err
		}
	}
	return nil
}

func consumeKafka(ctx context.Context, brokers []string, emit func(string, time.Time) error) error {
	// From the start: the topic is the run's own, and the bench waits for
	// a warm-up event before it measures.
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(benchTopic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(time.Second))
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
				if h.Key == core.HeaderEventID && err == nil {
					err = emit(string(h.Value), at)
				}
			}
		})
		if err != nil {
			return err
		}
	}
}
