package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	//lint:ignore SA1019 watermill-googlecloud v1.2.1 is built on pubsub v1, whose types it takes
	"cloud.google.com/go/pubsub"
	"cloud.google.com/go/pubsub/pstest"
	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	wmamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wmgc "github.com/ThreeDotsLabs/watermill-googlecloud/pkg/googlecloud"
	wmkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kfake"
	"google.golang.org/api/option"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/amqp"
	"github.com/outboxhq/outbox/brokers/googlecloud"
	"github.com/outboxhq/outbox/brokers/kafka"
	"github.com/outboxhq/outbox/brokers/wm"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
)

const benchTopic = "bench"

// brokerCase is one broker: the relay's adapter for it and a Watermill
// publisher set up the same way, to drive directly.
type brokerCase struct {
	name  string
	note  string
	setup func(ctx context.Context) (relay core.Publisher, direct message.Publisher, cleanup func(), err error)
	// empty, when set, removes what earlier runs left in the broker, so
	// that each run publishes into the same state.
	empty func(ctx context.Context) error
}

func (b *bench) brokerSection(ctx context.Context, rep *report) error {
	routing := &brokers.Routing{Fixed: benchTopic}
	cases := []brokerCase{
		{name: "Kafka (kfake, in process)", note: "acks=all, idempotent", setup: func(ctx context.Context) (core.Publisher, message.Publisher, func(), error) {
			kf, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.AllowAutoTopicCreation(), kfake.DefaultNumPartitions(4))
			if err != nil {
				return nil, nil, nil, fmt.Errorf("start kfake: %w", err)
			}
			addrs := kf.ListenAddrs()
			relay, err := kafka.New(ctx, kafka.Config{Brokers: addrs}, routing, b.log)
			if err != nil {
				kf.Close()
				return nil, nil, nil, err
			}
			// The same producer settings the adapter uses.
			sc := wmkafka.DefaultSaramaSyncPublisherConfig()
			sc.Producer.RequiredAcks = sarama.WaitForAll
			sc.Producer.Idempotent = true
			sc.Net.MaxOpenRequests = 1
			sc.Version = sarama.DefaultVersion
			direct, err := wmkafka.NewPublisher(wmkafka.PublisherConfig{Brokers: addrs, OverwriteSaramaConfig: sc,
				Marshaler: wmkafka.NewWithPartitioningMarshaler(func(_ string, m *message.Message) (string, error) {
					return m.Metadata.Get(event.HeaderAggregateID), nil
				})}, watermill.NopLogger{})
			if err != nil {
				relay.Close()
				kf.Close()
				return nil, nil, nil, fmt.Errorf("direct kafka publisher: %w", err)
			}
			return relay, direct, func() { relay.Close(); direct.Close(); kf.Close() }, nil
		}},
		{name: "RabbitMQ (confirms)", note: "publisher confirms, persistent, durable exchange with a bound queue, emptied before each run", setup: func(ctx context.Context) (core.Publisher, message.Publisher, func(), error) {
			url := os.Getenv("OUTBOX_TEST_AMQP_URL")
			if url == "" || url == "none" {
				return nil, nil, nil, errNotMeasured("no RabbitMQ: OUTBOX_TEST_AMQP_URL is not set")
			}
			// The bound queue the direct publisher shares, emptied before each run.
			relay, err := amqp.New(ctx, amqp.Config{URL: url, Channels: b.cfg.Lanes, TopicQueues: true}, routing, b.log)
			if err != nil {
				return nil, nil, nil, err
			}
			cfg := wmamqp.NewDurablePubSubConfig(url, wmamqp.GenerateQueueNameTopicName)
			cfg.Exchange.Type = "topic" // as the adapter declares it
			cfg.Publish.ConfirmDelivery = true
			cfg.Publish.ChannelPoolSize = 64 // as many as the most publishers tried need
			cfg.Publish.GenerateRoutingKey = func(topic string) string { return topic }
			cfg.Marshaler = wmamqp.DefaultMarshaler{PostprocessPublishing: func(p amqp091.Publishing) amqp091.Publishing { return p }}
			direct, err := wmamqp.NewPublisher(cfg, watermill.NopLogger{})
			if err != nil {
				relay.Close()
				return nil, nil, nil, fmt.Errorf("direct amqp publisher: %w", err)
			}
			return relay, direct, func() { relay.Close(); direct.Close() }, nil
		}, empty: func(ctx context.Context) error { return emptyQueue(os.Getenv("OUTBOX_TEST_AMQP_URL"), benchTopic) }},
		{name: "Pub/Sub (pstest, in process)", note: "message ordering on the aggregate id", setup: func(ctx context.Context) (core.Publisher, message.Publisher, func(), error) {
			srv := pstest.NewServer()
			relay, err := googlecloud.New(ctx, googlecloud.Config{ProjectID: "bench", EmulatorHost: srv.Addr, CreateTopics: true}, routing, b.log)
			if err != nil {
				srv.Close()
				return nil, nil, nil, err
			}
			ps := pubsub.DefaultPublishSettings
			ps.DelayThreshold, ps.CountThreshold = 50*time.Microsecond, 1 // the adapter's defaults
			direct, err := wmgc.NewPublisher(wmgc.PublisherConfig{
				ProjectID: "bench", EnableMessageOrdering: true, EnableMessageOrderingAutoResumePublishOnError: true,
				PublishSettings: &ps,
				ClientOptions: []option.ClientOption{option.WithEndpoint(srv.Addr), option.WithoutAuthentication(),
					option.WithGRPCDialOption(grpc.WithTransportCredentials(insecure.NewCredentials())), option.WithTelemetryDisabled()},
				Marshaler: wmgc.NewOrderingMarshaler(func(_ string, m *message.Message) (string, error) {
					return m.Metadata.Get(event.HeaderAggregateID), nil
				}),
			}, watermill.NopLogger{})
			if err != nil {
				relay.Close()
				srv.Close()
				return nil, nil, nil, fmt.Errorf("direct pubsub publisher: %w", err)
			}
			return relay, direct, func() { relay.Close(); direct.Close(); srv.Close() }, nil
		}},
	}
	for _, c := range cases {
		row, err := b.brokerRun(ctx, c)
		if err != nil {
			if ctx.Err() != nil {
				return err
			}
			// One broker failing leaves its row empty, not the whole run.
			row = brokerRow{Broker: c.name, Note: "not measured: " + err.Error()}
			b.log.Warn("broker not measured", "broker", c.name, "error", err)
		}
		rep.Brokers = append(rep.Brokers, row)
	}
	return nil
}

// emptyQueue purges an AMQP queue, which may not exist yet. Publishes to
// a durable queue nobody consumes pile up, and RabbitMQ confirms more
// slowly behind a long queue: the relay's run and each direct one start
// with it empty.
func emptyQueue(url, queue string) error {
	conn, err := amqp091.Dial(url)
	if err != nil {
		return fmt.Errorf("empty queue %s: %w", queue, err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("empty queue %s: %w", queue, err)
	}
	if _, err := ch.QueuePurge(queue, false); err != nil {
		var aerr *amqp091.Error
		if errors.As(err, &aerr) && aerr.Code == amqp091.NotFound {
			return nil
		}
		return fmt.Errorf("empty queue %s: %w", queue, err)
	}
	return nil
}

type errNotMeasured string

func (e errNotMeasured) Error() string { return string(e) }

func (b *bench) brokerRun(ctx context.Context, c brokerCase) (brokerRow, error) {
	relayPub, direct, cleanup, err := c.setup(ctx)
	if err != nil {
		return brokerRow{}, err
	}
	defer cleanup()
	n := b.cfg.BrokerEvents

	cfg, drop, err := b.schema(ctx, "broker")
	if err != nil {
		return brokerRow{}, err
	}
	defer drop()
	if err := b.fill(ctx, cfg, n); err != nil {
		return brokerRow{}, err
	}
	empty := func() error {
		if c.empty == nil {
			return nil
		}
		return c.empty(ctx)
	}
	if err := empty(); err != nil {
		return brokerRow{}, err
	}
	b.settle(ctx)
	res, err := b.relayDrainWith(ctx, c.name, cfg, n, b.relayOptions(false, nil), relayPub, b.cfg.DrainCap)
	if err != nil {
		return brokerRow{}, err
	}

	// The direct figure is the best of several ways to drive the same
	// publisher: single-message publishes from more and more goroutines at
	// once, and one caller sending batches of 100.
	event := &core.Event{Seq: 1, ID: watermill.NewUUID(), AggregateID: aggregateID(1, b.cfg.Aggregates), Type: "bench.event",
		Payload: []byte(`{"n":1}`)}
	var best rate
	var tried []string
	for _, d := range []struct{ workers, perCall int }{{16, 1}, {64, 1}, {256, 1}, {1, 100}} {
		if err := empty(); err != nil {
			return brokerRow{}, err
		}
		r, err := driveDirect(ctx, direct, event, n, d.workers, d.perCall, b.cfg.DrainCap, b.cfg.Aggregates)
		if err != nil {
			return brokerRow{}, fmt.Errorf("drive %s directly with %d publishers: %w", c.name, d.workers, err)
		}
		r.Note = fmt.Sprintf("%d publishers, 1 message each", d.workers)
		if d.perCall > 1 {
			r.Note = fmt.Sprintf("1 publisher, batches of %d", d.perCall)
		}
		tried = append(tried, fmt.Sprintf("%s %s/s", r.Note, perSec(r.PerSec())))
		if r.PerSec() > best.PerSec() {
			best = r
		}
	}
	o := effective(b.relayOptions(false, nil))
	b.log.Info("broker", "name", c.name, "relay", int(res.PerSec()), "direct", tried)
	return brokerRow{Broker: c.name, Relay: res.rate, Direct: best, Measured: true,
		Note: fmt.Sprintf("%s; %d events; relay: %d lanes, %d claims open; direct best: %s (tried: %s)%s",
			c.note, n, o.Lanes, o.Claimers, best.Note, strings.Join(tried, ", "), brokerCPU(res.rate, best))}, nil
}

// brokerCPU says what each event cost in CPU: the relay's run (this
// process, with an in-process fake broker's share, and PostgreSQL's
// sessions of the relay) and the best direct run (this process), and how
// much of the machine the relay's run kept busy. With a fake in process,
// the relay and the broker share the cores the direct run had alone.
func brokerCPU(relay, direct rate) string {
	if relay.Events == 0 || direct.Events == 0 || relay.RelayCPU == 0 || relay.Elapsed <= 0 {
		return ""
	}
	per := func(d time.Duration, n int64) string { return fmt.Sprintf("%.0f us", float64(d)/float64(n)/1e3) }
	busy := float64(relay.RelayCPU+relay.DBCPU) / (relay.Elapsed.Seconds() * 1e9 * float64(runtime.NumCPU()))
	return fmt.Sprintf("; CPU per event: relay run %s (this process %s, PostgreSQL %s; %.0f%% of %d cores), direct best %s (this process)",
		per(relay.RelayCPU+relay.DBCPU, relay.Events), per(relay.RelayCPU, relay.Events), per(relay.DBCPU, relay.Events),
		100*busy, runtime.NumCPU(), per(direct.RelayCPU, direct.Events))
}

// driveDirect publishes n messages shaped like the relay's through pub, on
// workers goroutines, perCall messages to a call.
func driveDirect(ctx context.Context, pub message.Publisher, e *core.Event, n, workers, perCall int, limit time.Duration, aggregates int) (rate, error) {
	var next, sent atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	deadline := time.Now().Add(limit)
	var usage syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &usage)
	cpuBefore := rusageCPU(usage)
	start := time.Now()
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil && time.Now().Before(deadline) {
				first := next.Add(int64(perCall)) - int64(perCall)
				if first >= int64(n) {
					return
				}
				k := min(int64(perCall), int64(n)-first)
				msgs := make([]*message.Message, k)
				for i := range msgs {
					ev := *e
					ev.Seq = first + int64(i)
					ev.ID = watermill.NewUUID()
					ev.AggregateID = aggregateID(ev.Seq, aggregates)
					msgs[i] = wm.NewMessage(&ev)
				}
				if err := pub.Publish(benchTopic, msgs...); err != nil {
					errs <- err
					return
				}
				sent.Add(k)
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &usage)
	select {
	case err := <-errs:
		return rate{}, err
	default:
	}
	return rate{Events: sent.Load(), Elapsed: elapsed, RelayCPU: rusageCPU(usage) - cpuBefore}, nil
}
