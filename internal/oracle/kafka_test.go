package oracle_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/kafka"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
	"github.com/outboxhq/outbox/internal/oracle"
)

// topic is where every event of a history goes, on a Kafka path.
const (
	topic      = "oracle.events"
	partitions = 4
)

// kafkaSide is a history's Kafka cluster (in-process, one per history)
// and the consumer whose reads are the broker's record: records in the
// order it reads them, which within a partition is offset order. On the
// exactly-once path it reads committed records only.
type kafkaSide struct {
	path    oracle.Path
	cluster *kfake.Cluster
	cancel  context.CancelFunc
	done    chan struct{}
	reader  *kgo.Client

	mu sync.Mutex
	// seen are the producers (id and epoch) that have sent requests;
	// dead those of killed relays, whose requests the cluster swallows
	// from then on: a killed process sends nothing more, so what it
	// left open stays open until its successor fences it.
	seen, dead map[producer]bool
	txnIDs     map[int64]string // producer id -> transactional id, from the produce requests
	abandoned  []core.Publisher
}

type producer struct {
	id    int64
	epoch int16
}

func newKafkaSide(t *testing.T, path oracle.Path, b *broker) *kafkaSide {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.AllowAutoTopicCreation(),
		kfake.DefaultNumPartitions(partitions), kfake.SeedTopics(partitions, topic))
	if err != nil {
		t.Fatalf("start kafka: %v", err)
	}
	k := &kafkaSide{path: path, cluster: c, done: make(chan struct{}), seen: map[producer]bool{}, dead: map[producer]bool{}, txnIDs: map[int64]string{}}
	c.Control(k.control)
	k.reader, err = kgo.NewClient(kgo.SeedBrokers(c.ListenAddrs()...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.FetchMaxWait(100*time.Millisecond))
	if err != nil {
		c.Close()
		t.Fatalf("kafka consumer: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	k.cancel = cancel
	go k.read(ctx, b)
	t.Cleanup(k.stop)
	return k
}

// read records every record it reads as a delivery, until ctx ends.
func (k *kafkaSide) read(ctx context.Context, b *broker) {
	defer close(k.done)
	for {
		fs := k.reader.PollFetches(ctx)
		if ctx.Err() != nil {
			return
		}
		fs.EachRecord(func(r *kgo.Record) {
			id := ""
			for _, h := range r.Headers {
				if h.Key == event.HeaderEventID {
					id = string(h.Value)
				}
			}
			b.add(id, r.Timestamp, fmt.Sprintf("p%d@%d by %s", r.Partition, r.Offset, k.producerName(r.ProducerID, r.ProducerEpoch)))
		})
	}
}

// producerName names a producer by its transactional id and epoch.
func (k *kafkaSide) producerName(id int64, epoch int16) string {
	k.mu.Lock()
	defer k.mu.Unlock()
	if t, ok := k.txnIDs[id]; ok {
		return fmt.Sprintf("%s epoch %d", t, epoch)
	}
	return fmt.Sprintf("producer %d epoch %d", id, epoch)
}

// stop ends the consumer and the cluster; safe to call twice.
func (k *kafkaSide) stop() {
	k.mu.Lock()
	cancel := k.cancel
	k.cancel = nil
	k.mu.Unlock()
	if cancel == nil {
		return
	}
	cancel()
	<-k.done
	k.reader.Close()
	k.closeAbandoned()
	k.cluster.Close()
}

// publisher returns a new Kafka publisher: each relay process has its own.
func (k *kafkaSide) publisher(t *testing.T) core.Publisher {
	t.Helper()
	cfg := kafka.Config{Brokers: k.cluster.ListenAddrs()}
	if k.path == oracle.ExactlyOnce {
		exactlyOnce(&cfg)
	}
	pub, err := kafka.New(context.Background(), cfg, &brokers.Routing{Fixed: topic}, nil)
	if err != nil {
		t.Fatalf("kafka publisher: %v", err)
	}
	return pub
}

// abandon leaves a killed relay's publisher as a crash leaves it: its
// producers send nothing more (their transactions stay open until
// fenced), and it is closed only at the history's end.
func (k *kafkaSide) abandon(pub core.Publisher) {
	k.mu.Lock()
	defer k.mu.Unlock()
	for p := range k.seen {
		k.dead[p] = true
	}
	k.abandoned = append(k.abandoned, pub)
}

// leave keeps a killed relay's publisher running, unsilenced, until the
// history's end.
func (k *kafkaSide) leave(pub core.Publisher) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.abandoned = append(k.abandoned, pub)
}

// closeAbandoned closes the publishers of killed relays; the cluster
// still swallows their requests, so nothing they left open ends by it.
func (k *kafkaSide) closeAbandoned() {
	k.mu.Lock()
	pubs := k.abandoned
	k.abandoned = nil
	k.mu.Unlock()
	var wg sync.WaitGroup
	for _, p := range pubs {
		wg.Go(func() { _ = p.Close() })
	}
	wg.Wait()
}

// control runs on every request the cluster takes: it notes the
// producers that send and swallows the requests of dead ones.
func (k *kafkaSide) control(req kmsg.Request) (kmsg.Response, error, bool) {
	k.cluster.KeepControl()
	ps := producers(req)
	k.mu.Lock()
	defer k.mu.Unlock()
	if r, ok := req.(*kmsg.ProduceRequest); ok && r.TransactionID != nil {
		for _, p := range ps {
			k.txnIDs[p.id] = *r.TransactionID
		}
	}
	for _, p := range ps {
		if k.dead[p] {
			return nil, nil, true // no answer: the sender is gone
		}
		k.seen[p] = true
	}
	return nil, nil, false
}

// producers names the producers a request speaks for.
func producers(req kmsg.Request) []producer {
	var out []producer
	switch r := req.(type) {
	case *kmsg.ProduceRequest:
		for _, t := range r.Topics {
			for _, p := range t.Partitions {
				var rb kmsg.RecordBatch
				if rb.ReadFrom(p.Records) == nil && rb.ProducerID >= 0 {
					out = append(out, producer{rb.ProducerID, rb.ProducerEpoch})
				}
			}
		}
	case *kmsg.AddPartitionsToTxnRequest:
		if r.Version < 4 {
			out = append(out, producer{r.ProducerID, r.ProducerEpoch})
		}
		for _, t := range r.Transactions {
			out = append(out, producer{t.ProducerID, t.ProducerEpoch})
		}
	case *kmsg.AddOffsetsToTxnRequest:
		out = append(out, producer{r.ProducerID, r.ProducerEpoch})
	case *kmsg.EndTxnRequest:
		out = append(out, producer{r.ProducerID, r.ProducerEpoch})
	case *kmsg.InitProducerIDRequest:
		if r.ProducerID >= 0 {
			out = append(out, producer{r.ProducerID, r.ProducerEpoch})
		}
	}
	return out
}

// fail makes the cluster fail requests as the step says.
func (k *kafkaSide) fail(s oracle.Step) {
	switch s.Kind {
	case oracle.FailProduce:
		if s.Target == 3 {
			// Appended, then answered as timed out: the producer
			// cannot tell, and sends it again.
			k.cluster.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.RequestTimedOut})
			return
		}
		k.cluster.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.UnknownServerError, Count: s.Target})
	case oracle.FailCommit:
		k.cluster.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.EndTxn}, Err: kerr.UnknownServerError, Count: s.Target,
			When: func(req kmsg.Request) bool {
				r, ok := req.(*kmsg.EndTxnRequest)
				return ok && r.Commit
			}})
	}
}

// faulty fails the events the history says before its publisher sees
// them, as the in-process broker does: per event, transient or
// permanent. Bound, it binds its publisher and fails before the bound one.
type faulty struct {
	core.Publisher
	b *broker
}

func (f *faulty) Publish(ctx context.Context, e *core.Event) error {
	if err := f.b.admit(e.ID); err != nil {
		return err
	}
	return f.Publisher.Publish(ctx, e)
}

func (f *faulty) Sent(ctx context.Context, e *core.Event) (bool, error) {
	if c, ok := f.Publisher.(core.Committer); ok {
		return c.Sent(ctx, e)
	}
	return false, nil
}

func (f *faulty) Bind(src core.Source) (core.Publisher, error) {
	b, ok := f.Publisher.(core.Binder)
	if !ok {
		return f, nil
	}
	p, err := b.Bind(src)
	if err != nil {
		return nil, err
	}
	return &faulty{Publisher: p, b: f.b}, nil
}
