package kafka

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"
	wmkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	kscram "github.com/twmb/franz-go/pkg/sasl/scram"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/wm"
	"github.com/outboxhq/outbox/core"
)

const (
	// DefaultTransactionTimeout is transaction_timeout's default.
	DefaultTransactionTimeout = time.Minute
	// MaxTransactionTimeout is the broker's default
	// transaction.max.timeout.ms; a longer timeout is refused.
	MaxTransactionTimeout = 15 * time.Minute

	// maxOpen bounds how long a transaction takes in events that arrive
	// after it began: their publishes wait for it.
	maxOpen = 50 * time.Millisecond
	// maxTxnEvents and maxTxnBytes bound one transaction.
	maxTxnEvents = 2000
	maxTxnBytes  = 4 << 20
	// pruneEvery is how often a source is asked which carried events it
	// has settled.
	pruneEvery = 300 * time.Millisecond
	// abortTimeout bounds aborting a dropped producer's transaction.
	abortTimeout = 2 * time.Second
	// closeTimeout bounds Close's wait for transactions in progress.
	closeTimeout = 5 * time.Second
)

// TxPublisher is the exactly-once publisher (Config.ExactlyOnce). The
// relay binds it to its source, which must be a core.Settler; the bound
// publisher keeps, per unit of the source, one transactional producer
// with the id <transactional_id_prefix>.<source>.<unit>, and writes each
// transaction's progress record to partition unit of the compacted topic
// <progress_topic_prefix>.<source>.
//
// An event is published only once a transaction holding it committed,
// and that transaction's progress record names it and every event of its
// unit the producer committed earlier that the source may not yet have
// settled. A producer takes its unit at its first publish, and again after
// any transaction error: it fences the previous producer of the unit (its
// open transaction is aborted), then reads the unit's latest committed
// progress record and keeps the events the source has not settled; those
// are in Kafka already, and publishing one again returns nil without
// sending it. So an event reaches read_committed consumers once, whatever
// relay dies, freezes or takes over in between.
//
// Publish on the unbound TxPublisher fails; Close ends every bound
// producer, aborting open transactions.
type TxPublisher struct {
	s       Config
	topics  *brokers.Routing
	log     *slog.Logger
	opts    func() []kgo.Opt // how every client reaches the cluster
	meta    *kgo.Client
	admin   *kadm.Client
	marshal wmkafka.Marshaler
	ctx     context.Context // ends with Close
	cancel  context.CancelFunc
	runners sync.WaitGroup

	mu     sync.Mutex
	bound  map[string]*boundPub // by source name
	closed bool

	hooks hooks
}

// hooks let tests stop a transaction at its critical points.
type hooks struct {
	beforeEnd func(unit int) // after the flush, before EndTransaction
}

var (
	_ core.Publisher = (*TxPublisher)(nil)
	_ core.Binder    = (*TxPublisher)(nil)
	_ core.Pinger    = (*TxPublisher)(nil)
)

// NewTx connects to the cluster (an unreachable one is an error) and
// returns the exactly-once publisher, whatever s.ExactlyOnce says.
func NewTx(ctx context.Context, s Config, topics *brokers.Routing, log *slog.Logger) (*TxPublisher, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	s = s.withDefaults()
	if s.Acks != "all" {
		return nil, fmt.Errorf("kafka: exactly_once needs acks all, not %q", s.Acks)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if topics == nil {
		topics = &brokers.Routing{}
	}
	opts, err := s.kgoOpts(log)
	if err != nil {
		return nil, err
	}
	meta, err := kgo.NewClient(opts()...)
	if err != nil {
		return nil, fmt.Errorf("kafka: %w", err)
	}
	pctx, cancel := context.WithTimeout(ctx, s.DialTimeout)
	defer cancel()
	if err := meta.Ping(pctx); err != nil {
		meta.Close()
		return nil, fmt.Errorf("connect to kafka %v: %w", s.Brokers, err)
	}
	p := &TxPublisher{s: s, topics: topics, log: log, opts: opts, meta: meta, admin: kadm.NewClient(meta), marshal: marshaler(),
		bound: map[string]*boundPub{}}
	p.ctx, p.cancel = context.WithCancel(context.Background())
	log.Info("kafka publisher ready", "brokers", s.Brokers, "exactly_once", true, "transaction_timeout", s.TransactionTimeout)
	return p, nil
}

// kgoOpts maps the settings to franz-go's. Each client gets options of
// its own: franz-go rewrites some of their contents as it starts.
func (s Config) kgoOpts(log *slog.Logger) (func() []kgo.Opt, error) {
	var tlsOpt []kgo.Opt
	if s.TLS {
		tc, err := brokers.TLSFiles{CAFile: s.TLSCAFile, CertFile: s.TLSCertFile, KeyFile: s.TLSKeyFile,
			ServerName: s.TLSServerName, InsecureSkipVerify: s.TLSInsecureSkipVerify}.Config()
		if err != nil {
			return nil, fmt.Errorf("kafka: %w", err)
		}
		tlsOpt = append(tlsOpt, kgo.DialTLSConfig(tc))
	}
	return func() []kgo.Opt { return append(s.clientOpts(log), tlsOpt...) }, nil
}

func (s Config) clientOpts(log *slog.Logger) []kgo.Opt {
	codec := map[string]kgo.CompressionCodec{
		"none": kgo.NoCompression(), "gzip": kgo.GzipCompression(), "snappy": kgo.SnappyCompression(),
		"lz4": kgo.Lz4Compression(), "zstd": kgo.ZstdCompression(),
	}[s.Compression]
	opts := []kgo.Opt{
		kgo.SeedBrokers(s.Brokers...), kgo.ClientID(s.ClientID), kgo.DialTimeout(s.DialTimeout),
		kgo.RequiredAcks(kgo.AllISRAcks()), kgo.ProduceRequestTimeout(s.Timeout),
		kgo.RecordDeliveryTimeout(2 * s.Timeout), kgo.ProducerBatchCompression(codec),
		kgo.ProducerBatchMaxBytes(int32(max(s.MaxMessageBytes, 1<<20))), kgo.AllowAutoTopicCreation(),
		kgo.WithLogger(kgoLogger{log}), kgo.ProducerLinger(0), // a transaction waits for its records
	}
	switch s.SASLMechanism {
	case sarama.SASLTypePlaintext:
		opts = append(opts, kgo.SASL(plain.Auth{User: s.SASLUser, Pass: s.SASLPassword}.AsMechanism()))
	case sarama.SASLTypeSCRAMSHA256:
		opts = append(opts, kgo.SASL(kscram.Auth{User: s.SASLUser, Pass: s.SASLPassword}.AsSha256Mechanism()))
	case sarama.SASLTypeSCRAMSHA512:
		opts = append(opts, kgo.SASL(kscram.Auth{User: s.SASLUser, Pass: s.SASLPassword}.AsSha512Mechanism()))
	}
	return opts
}

// kgoLogger passes franz-go's warnings and errors on; its info and debug
// lines are per request.
type kgoLogger struct{ log *slog.Logger }

func (l kgoLogger) Level() kgo.LogLevel { return kgo.LogLevelWarn }

func (l kgoLogger) Log(level kgo.LogLevel, msg string, keyvals ...any) {
	lvl := slog.LevelWarn
	if level == kgo.LogLevelError {
		lvl = slog.LevelError
	}
	l.log.Log(context.Background(), lvl, "kafka client: "+msg, keyvals...)
}

// Publish fails: the relay publishes through the publisher Bind returns.
func (p *TxPublisher) Publish(context.Context, *core.Event) error {
	return errors.New("kafka exactly_once: publish through the publisher Bind returns for the relay's source")
}

// Ping asks a broker for its API versions.
func (p *TxPublisher) Ping(ctx context.Context) error { return p.meta.Ping(ctx) }

// Bind returns the publisher for src's events. src must be a core.Settler;
// Bind creates its progress topic when missing, and fails when the topic
// has fewer partitions than src has units.
func (p *TxPublisher) Bind(src core.Source) (core.Publisher, error) {
	st, ok := src.(core.Settler)
	if !ok {
		return nil, fmt.Errorf("kafka exactly_once: source %T is not a core.Settler (it has no Units and Unsettled), "+
			"so it cannot say which events a crashed relay committed in Kafka", src)
	}
	name, n := st.Units()
	if n < 1 {
		return nil, fmt.Errorf("kafka exactly_once: source %q has %d units", name, n)
	}
	name = sanitize(name)
	// A source bound again (the log relay binds each replication
	// session's stream) keeps its producers and what they committed.
	p.mu.Lock()
	if b := p.bound[name]; b != nil && !b.closed() {
		p.mu.Unlock()
		if len(b.units) != n {
			return nil, fmt.Errorf("kafka exactly_once: source %q bound again with %d units, was %d", name, n, len(b.units))
		}
		b.srcMu.Lock()
		b.src = st
		b.srcMu.Unlock()
		return b, nil
	}
	p.mu.Unlock()
	b := &boundPub{p: p, src: st, name: name, progress: p.s.ProgressTopicPrefix + "." + name}
	if err := checkName(b.progress); err != nil {
		return nil, fmt.Errorf("kafka exactly_once: progress topic: %w", err)
	}
	ctx, cancel := context.WithTimeout(p.ctx, p.s.DialTimeout+p.s.Timeout)
	defer cancel()
	if err := p.ensureTopic(ctx, b.progress, n); err != nil {
		return nil, fmt.Errorf("kafka exactly_once: progress topic %s: %w", b.progress, err)
	}
	for u := range n {
		b.units = append(b.units, &unit{b: b, n: u, txnID: p.s.TransactionalIDPrefix + "." + name + "." + strconv.Itoa(u),
			wake: make(chan struct{}, 1), kafka: map[string]core.Sent{}})
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, errors.New("kafka exactly_once: publisher is closed")
	}
	if old := p.bound[name]; old != nil && !old.closed() {
		b.closeUnits() // bound meanwhile by another relay
		return old, nil
	}
	p.bound[name] = b
	return b, nil
}

// ensureTopic creates the compacted progress topic with n partitions, or
// checks that the one there has at least n.
func (p *TxPublisher) ensureTopic(ctx context.Context, topic string, n int) error {
	bs, err := p.admin.ListBrokers(ctx)
	if err != nil {
		return fmt.Errorf("list brokers: %w", err)
	}
	rf := int16(min(3, max(1, len(bs))))
	compact := "compact"
	_, err = p.admin.CreateTopic(ctx, int32(n), rf, map[string]*string{"cleanup.policy": &compact}, topic)
	if err == nil {
		p.log.Info("created progress topic", "topic", topic, "partitions", n, "replication_factor", rf)
		return nil
	}
	if !errors.Is(err, kerr.TopicAlreadyExists) {
		return fmt.Errorf("create: %w", err)
	}
	ds, err := p.admin.ListTopics(ctx, topic)
	if err != nil {
		return fmt.Errorf("describe: %w", err)
	}
	d, ok := ds[topic]
	if !ok || d.Err != nil {
		return fmt.Errorf("describe: %w", errors.Join(errors.New("not listed"), d.Err))
	}
	if got := len(d.Partitions); got < n {
		return fmt.Errorf("has %d partitions, needs %d (one per unit of the source); add partitions or delete it", got, n)
	}
	return nil
}

// Close ends every bound producer: transactions in progress are aborted
// (bounded), none is committed.
func (p *TxPublisher) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	bound := p.bound
	p.mu.Unlock()
	p.cancel()
	done := make(chan struct{})
	go func() { p.runners.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(closeTimeout):
		p.log.Warn("kafka exactly_once: transactions still ending at close")
	}
	for _, b := range bound {
		b.closeUnits()
	}
	p.meta.Close()
	return nil
}

// boundPub publishes one source's events.
type boundPub struct {
	p        *TxPublisher
	srcMu    sync.Mutex
	src      core.Settler // the source last bound under name
	name     string       // the source's, with characters Kafka refuses replaced
	progress string
	units    []*unit

	pruneMu   sync.Mutex
	pruning   bool
	lastPrune time.Time
}

var (
	_ core.Publisher = (*boundPub)(nil)
	_ core.Pinger    = (*boundPub)(nil)
	_ core.Committer = (*boundPub)(nil)
)

// unit is one unit's producer and its events in flight.
type unit struct {
	b     *boundPub
	n     int
	txnID string
	wake  chan struct{} // an event was queued while a transaction runs

	takeMu sync.Mutex // held through a take

	mu      sync.Mutex
	queue   []*pending
	running bool
	closed  bool
	cl      *kgo.Client // nil: not taken
	// kafka holds the unit's events committed in Kafka that the source
	// may not have settled: found at the take (the skip set) or committed
	// since (the carried set). Publishing one returns nil unsent.
	kafka map[string]core.Sent
}

// pending is one publish waiting for its transaction.
type pending struct {
	rec  *kgo.Record
	sent core.Sent
	size int
	done chan error // buffered
	err  error      // the record's own produce error
	// others are publishes of the same event queued while its
	// transaction ran; only the unit's runner touches them.
	others []*pending
}

// source is the source last bound.
func (b *boundPub) source() core.Settler {
	b.srcMu.Lock()
	defer b.srcMu.Unlock()
	return b.src
}

// sentOf is how a progress record names e.
func sentOf(e *core.Event) core.Sent {
	return core.Sent{Unit: e.Unit, Seq: e.Seq, ID: e.ID, Replays: e.Replays}
}

// Sent implements core.Committer: whether e is in Kafka already,
// committed and not settled, taking e's unit first when no producer
// holds it.
func (b *boundPub) Sent(ctx context.Context, e *core.Event) (bool, error) {
	if e.Unit < 0 || e.Unit >= len(b.units) {
		return false, nil // Publish refuses it
	}
	u := b.units[e.Unit]
	if _, err := u.take(ctx); err != nil {
		return false, fmt.Errorf("take unit %d of %s: %w", u.n, b.name, classifyTx(err))
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.kafka[e.ID] == sentOf(e), nil
}

// Ping asks a broker for its API versions.
func (b *boundPub) Ping(ctx context.Context) error { return b.p.Ping(ctx) }

// Close ends the source's producers; the TxPublisher's Close does too.
func (b *boundPub) Close() error {
	b.closeUnits()
	return nil
}

// Publish returns nil once a transaction holding e committed, or at once
// when e is committed in Kafka already. A ctx that ends first returns its
// error; the transaction may still commit, and the retry then finds e
// committed.
func (b *boundPub) Publish(ctx context.Context, e *core.Event) error {
	topic, err := b.p.topics.Topic(e)
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if e.Unit < 0 || e.Unit >= len(b.units) {
		return core.Permanent(fmt.Errorf("event %d: unit %d is not between 0 and %d", e.Seq, e.Unit, len(b.units)-1))
	}
	// A transaction that failed for a reason of its own (a broker's
	// transient error) is tried once more at once, with a new producer:
	// the engine's retry would wait its backoff.
	for attempt := 0; ; attempt++ {
		rec, size, err := b.p.record(topic, e)
		if err != nil {
			return err
		}
		pd := &pending{rec: rec, size: size, sent: sentOf(e), done: make(chan error, 1)}
		if err := b.units[e.Unit].enqueue(pd); err != nil {
			return err
		}
		select {
		case err = <-pd.done:
		case <-ctx.Done():
			return fmt.Errorf("publish to %s: %w", topic, ctx.Err())
		}
		if err == nil || attempt > 0 || ctx.Err() != nil || core.IsPermanent(err) || core.IsUndeliverable(err) {
			return err
		}
		b.p.log.Debug("kafka exactly_once: transaction failed; trying once more", "event_seq", e.Seq, "error", err)
	}
}

// record builds e's Kafka record as the plain path does: Watermill's
// message, marshalled by the same marshaler. Its partition is chosen by
// the same partitioner when produced.
func (p *TxPublisher) record(topic string, e *core.Event) (*kgo.Record, int, error) {
	m, err := p.marshal.Marshal(topic, wm.NewMessage(e))
	if err != nil {
		return nil, 0, core.Permanent(fmt.Errorf("marshal event %d: %w", e.Seq, err))
	}
	rec := &kgo.Record{Topic: topic}
	if rec.Key, err = m.Key.Encode(); err != nil {
		return nil, 0, core.Permanent(fmt.Errorf("marshal event %d: %w", e.Seq, err))
	}
	if rec.Value, err = m.Value.Encode(); err != nil {
		return nil, 0, core.Permanent(fmt.Errorf("marshal event %d: %w", e.Seq, err))
	}
	size := len(rec.Key) + len(rec.Value) + 70 // Sarama's record overhead, roughly
	for _, h := range m.Headers {
		rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: string(h.Key), Value: h.Value})
		size += len(h.Key) + len(h.Value) + 2
	}
	if size > p.s.MaxMessageBytes {
		return nil, 0, core.Permanent(fmt.Errorf("publish to %s: event %d is %d bytes, over max_message_bytes %d", topic, e.Seq, size, p.s.MaxMessageBytes))
	}
	return rec, size, nil
}

func (u *unit) enqueue(pd *pending) error {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.closed {
		return errors.New("kafka exactly_once: publisher is closed")
	}
	u.queue = append(u.queue, pd)
	if u.running {
		select {
		case u.wake <- struct{}{}:
		default:
		}
		return nil
	}
	u.running = true
	u.b.p.runners.Add(1)
	go u.run()
	return nil
}

// run commits the unit's queued events, one transaction at a time, until
// none is queued.
func (u *unit) run() {
	defer u.b.p.runners.Done()
	for {
		batch := u.grab(nil)
		if len(batch) == 0 {
			return
		}
		u.txn(batch)
	}
}

// grab takes the queued events; with none queued and in nil (between
// transactions), the runner ends. Events in the unit's committed set
// return nil at once; those already in the transaction (in) wait for it.
func (u *unit) grab(in map[string]*pending) []*pending {
	u.mu.Lock()
	defer u.mu.Unlock()
	q := u.queue
	u.queue = nil
	if u.cl != nil {
		q = u.skip(q, in)
	} // else not taken: the skip set is not known yet
	if len(q) == 0 && in == nil {
		u.running = false
	}
	return q
}

// skip answers the events committed already and drops those the
// transaction holds, whose waiters it adds to the first's. u.mu is held.
func (u *unit) skip(q []*pending, in map[string]*pending) []*pending {
	out := q[:0]
	for _, pd := range q {
		if u.kafka[pd.sent.ID] == pd.sent {
			pd.deliver(nil) // in Kafka already; a replay since is not
			continue
		}
		if first, ok := in[pd.sent.ID]; ok {
			// An engine retry of an event this transaction holds (its
			// first publish timed out): it waits for the same outcome.
			first.others = append(first.others, pd)
			continue
		}
		if in != nil {
			in[pd.sent.ID] = pd
		}
		out = append(out, pd)
	}
	return out
}

// deliver answers pd's publish and those of its retries.
func (pd *pending) deliver(err error) {
	pd.done <- err
	for _, o := range pd.others {
		o.done <- err
	}
}

// txn commits batch, and the events queued while it runs, in one
// transaction with the unit's progress record.
func (u *unit) txn(batch []*pending) {
	p := u.b.p
	ctx, cancel := context.WithTimeout(p.ctx, p.s.DialTimeout+2*p.s.Timeout)
	defer cancel()
	cl, err := u.take(ctx)
	if err != nil {
		finish(batch, fmt.Errorf("take unit %d of %s: %w", u.n, u.b.name, classifyTx(err)))
		return
	}
	in := map[string]*pending{}
	u.mu.Lock()
	batch = u.skip(batch, in)
	u.mu.Unlock()
	if len(batch) == 0 {
		return
	}
	if err := cl.BeginTransaction(); err != nil {
		u.drop(cl)
		finish(batch, fmt.Errorf("begin transaction: %w", classifyTx(err)))
		return
	}
	acked := make(chan struct{}, 1)
	var outstanding sync.WaitGroup
	var inFlight int
	var flightMu sync.Mutex
	produce := func(pds []*pending) {
		for _, pd := range pds {
			flightMu.Lock()
			inFlight++
			flightMu.Unlock()
			outstanding.Add(1)
			cl.Produce(ctx, pd.rec, func(_ *kgo.Record, err error) {
				pd.err = err
				flightMu.Lock()
				inFlight--
				flightMu.Unlock()
				outstanding.Done()
				select {
				case acked <- struct{}{}:
				default:
				}
			})
		}
	}
	produce(batch)
	count, bytes := len(batch), 0
	for _, pd := range batch {
		bytes += pd.size
	}
	// Events that arrive while the batch is produced join it, until it is
	// acknowledged, maxOpen passed or the transaction is full.
	timer := time.NewTimer(maxOpen)
collect:
	for count < maxTxnEvents && bytes < maxTxnBytes {
		flightMu.Lock()
		idle := inFlight == 0
		flightMu.Unlock()
		if idle && len(u.wake) == 0 {
			break
		}
		select {
		case <-u.wake:
		case <-acked:
			continue
		case <-timer.C:
			break collect
		}
		more := u.grab(in)
		produce(more)
		batch = append(batch, more...)
		count += len(more)
		for _, pd := range more {
			bytes += pd.size
		}
	}
	timer.Stop()

	progress, err := u.progressRecord(batch)
	if err != nil {
		u.abort(cl, batch, err, outstanding.Wait)
		return
	}
	var progressErr error
	outstanding.Add(1)
	cl.Produce(ctx, progress, func(_ *kgo.Record, err error) { progressErr = err; outstanding.Done() })
	if err := cl.Flush(ctx); err != nil {
		u.abort(cl, batch, fmt.Errorf("flush: %w", err), outstanding.Wait)
		return
	}
	outstanding.Wait()
	if failed := recordErrors(batch, progressErr); failed != nil {
		u.abort(cl, batch, failed, func() {})
		return
	}
	if p.hooks.beforeEnd != nil {
		p.hooks.beforeEnd(u.n)
	}
	if err := cl.EndTransaction(ctx, kgo.TryCommit); err != nil {
		// Committed or not, no one knows: the next take reads what did.
		u.drop(cl)
		finish(batch, fmt.Errorf("commit transaction of unit %d of %s: %w", u.n, u.b.name, classifyTx(err)))
		return
	}
	u.mu.Lock()
	for _, pd := range batch {
		u.kafka[pd.sent.ID] = pd.sent
	}
	u.mu.Unlock()
	finish(batch, nil)
	u.b.maybePrune()
}

// progressRecord names the transaction's events and the unit's carried
// ones: every event of the unit committed in Kafka and maybe unsettled.
func (u *unit) progressRecord(batch []*pending) (*kgo.Record, error) {
	var pr progressValue
	u.mu.Lock()
	pr.Events = make([]progressEvent, 0, len(batch)+len(u.kafka))
	for _, s := range u.kafka {
		pr.Events = append(pr.Events, progressEvent{Seq: s.Seq, ID: s.ID, Replays: s.Replays})
	}
	u.mu.Unlock()
	for _, pd := range batch {
		pr.Events = append(pr.Events, progressEvent{Seq: pd.sent.Seq, ID: pd.sent.ID, Replays: pd.sent.Replays})
	}
	v, err := json.Marshal(pr)
	if err != nil {
		return nil, fmt.Errorf("progress record: %w", err)
	}
	return &kgo.Record{Topic: u.b.progress, Partition: int32(u.n), Key: []byte(strconv.Itoa(u.n)), Value: v}, nil
}

// progressValue is a progress record's value.
type progressValue struct {
	Events []progressEvent `json:"events"`
}

type progressEvent struct {
	Seq     int64  `json:"seq"`
	ID      string `json:"id"`
	Replays int    `json:"replays,omitempty"`
}

// recordErrors returns the error that fails the transaction, or nil, and
// gives each event its own: permanent for the one record Kafka refused
// for itself (too large, a bad topic), transient for the others.
func recordErrors(batch []*pending, progressErr error) error {
	var first error
	var refused []*pending
	for _, pd := range batch {
		if pd.err == nil {
			continue
		}
		if first == nil {
			first = pd.err
		}
		if refusedRecord(pd.err) {
			refused = append(refused, pd)
		}
	}
	if first == nil && progressErr != nil {
		first = fmt.Errorf("progress record: %w", progressErr)
	}
	if first == nil {
		return nil
	}
	// A batch-level refusal fails every record of the batch: only a
	// record refused alone is known to be the reason.
	if len(refused) == 1 {
		refused[0].err = core.Permanent(refused[0].err)
	}
	return first
}

// abort ends the transaction unsent and fails batch with err (each event
// its own error when it has one); wait returns once every record's
// promise ran.
func (u *unit) abort(cl *kgo.Client, batch []*pending, err error, wait func()) {
	u.drop(cl)
	wait()
	err = fmt.Errorf("transaction of unit %d of %s aborted: %w", u.n, u.b.name, classifyTx(err))
	for _, pd := range batch {
		e := err
		if core.IsPermanent(pd.err) {
			e = pd.err
		}
		pd.deliver(e)
	}
}

func finish(batch []*pending, err error) {
	for _, pd := range batch {
		pd.deliver(err)
	}
}

// take makes the unit's producer when it has none: it fences the previous
// owner, then reads the unit's latest committed progress and keeps what
// the source has not settled.
func (u *unit) take(ctx context.Context) (*kgo.Client, error) {
	// One take at a time: two producers of one id would fence each other.
	u.takeMu.Lock()
	defer u.takeMu.Unlock()
	u.mu.Lock()
	cl := u.cl
	u.mu.Unlock()
	if cl != nil {
		return cl, nil
	}
	p := u.b.p
	opts := append(p.opts(), kgo.TransactionalID(u.txnID), kgo.TransactionTimeout(p.s.TransactionTimeout),
		kgo.RecordPartitioner(partitioner{progress: u.b.progress, hash: p.s.partitioner()}))
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return nil, err
	}
	if _, _, err := cl.ProducerID(ctx); err != nil {
		cl.Close()
		return nil, fmt.Errorf("fence: %w", err)
	}
	events, err := u.b.readProgress(ctx, u.n)
	if err != nil {
		cl.Close()
		return nil, err
	}
	u.mu.Lock()
	latest := map[string]core.Sent{}
	for _, s := range append(events, slices.Collect(maps.Values(u.kafka))...) {
		if l, ok := latest[s.ID]; !ok || s.Replays > l.Replays {
			latest[s.ID] = s
		}
	}
	u.mu.Unlock()
	events = slices.Collect(maps.Values(latest))
	left := events
	if len(events) > 0 {
		if left, err = u.b.source().Unsettled(ctx, events); err != nil {
			cl.Close()
			return nil, fmt.Errorf("ask the source which committed events are settled: %w", err)
		}
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.closed {
		cl.Close()
		return nil, errors.New("kafka exactly_once: publisher is closed")
	}
	u.kafka = make(map[string]core.Sent, len(left))
	for _, s := range left {
		u.kafka[s.ID] = s
	}
	u.cl = cl
	p.log.Debug("took unit", "transactional_id", u.txnID, "committed_unsettled", len(left))
	return cl, nil
}

// drop ends the unit's producer: its open transaction is aborted when the
// broker answers in time, and the next publish takes the unit again.
func (u *unit) drop(cl *kgo.Client) {
	u.mu.Lock()
	if u.cl == cl {
		u.cl = nil
	}
	u.mu.Unlock()
	endProducer(cl)
}

func endProducer(cl *kgo.Client) {
	ctx, cancel := context.WithTimeout(context.Background(), abortTimeout)
	defer cancel()
	_ = cl.AbortBufferedRecords(ctx)
	_ = cl.EndTransaction(ctx, kgo.TryAbort)
	cl.Close()
}

// closed reports whether Close ended b's producers.
func (b *boundPub) closed() bool {
	u := b.units[0]
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.closed
}

func (b *boundPub) closeUnits() {
	for _, u := range b.units {
		u.mu.Lock()
		u.closed = true
		cl := u.cl
		u.cl = nil
		q := u.queue
		u.queue = nil
		u.mu.Unlock()
		finish(q, errors.New("kafka exactly_once: publisher is closed"))
		if cl != nil {
			endProducer(cl)
		}
	}
}

// readProgress returns the events named by partition n's latest committed
// record: read_committed, up to the last stable offset.
func (b *boundPub) readProgress(ctx context.Context, n int) ([]core.Sent, error) {
	offs, err := b.p.admin.ListCommittedOffsets(ctx, b.progress)
	if err == nil {
		err = offs.Error()
	}
	if err != nil {
		return nil, fmt.Errorf("read progress: list offsets of %s: %w", b.progress, err)
	}
	o, ok := offs.Lookup(b.progress, int32(n))
	if !ok {
		return nil, fmt.Errorf("read progress: %s has no partition %d", b.progress, n)
	}
	stable := o.Offset
	for back := int64(16); stable > 0; back *= 8 {
		start := max(0, stable-back)
		rec, err := b.lastCommitted(ctx, int32(n), start, stable)
		if err != nil {
			return nil, fmt.Errorf("read progress of %s partition %d: %w", b.progress, n, err)
		}
		if rec != nil {
			var pv progressValue
			if err := json.Unmarshal(rec.Value, &pv); err != nil {
				return nil, fmt.Errorf("read progress of %s partition %d offset %d: %w", b.progress, n, rec.Offset, err)
			}
			out := make([]core.Sent, len(pv.Events))
			for i, e := range pv.Events {
				out[i] = core.Sent{Unit: n, Seq: e.Seq, ID: e.ID, Replays: e.Replays}
			}
			return out, nil
		}
		if start == 0 {
			break
		}
	}
	return nil, nil
}

// lastCommitted returns the last committed data record of partition n in
// [start, stable), or nil. Transaction markers come through too, so the
// read knows when it reached the stable offset.
func (b *boundPub) lastCommitted(ctx context.Context, n int32, start, stable int64) (*kgo.Record, error) {
	opts := append(b.p.opts(),
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{b.progress: {n: kgo.NewOffset().At(start)}}),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()), kgo.KeepControlRecords(), kgo.FetchMaxWait(200*time.Millisecond))
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	var last *kgo.Record
	for {
		f := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		var ferr error
		f.EachError(func(_ string, _ int32, err error) { ferr = err })
		if ferr != nil {
			return nil, ferr
		}
		reached := false
		f.EachRecord(func(r *kgo.Record) {
			if r.Offset >= stable {
				reached = true
				return
			}
			if !r.Attrs.IsControl() {
				last = r
			}
			if r.Offset == stable-1 {
				reached = true
			}
		})
		if reached {
			return last, nil
		}
	}
}

// maybePrune asks the source, at most every pruneEvery, which carried
// events it has settled, and forgets them.
func (b *boundPub) maybePrune() {
	b.pruneMu.Lock()
	if b.pruning || time.Since(b.lastPrune) < pruneEvery {
		b.pruneMu.Unlock()
		return
	}
	b.pruning = true
	b.pruneMu.Unlock()
	b.p.runners.Add(1)
	go func() {
		defer b.p.runners.Done()
		b.prune()
		b.pruneMu.Lock()
		b.pruning = false
		b.lastPrune = time.Now()
		b.pruneMu.Unlock()
	}()
}

func (b *boundPub) prune() {
	var all []core.Sent
	for _, u := range b.units {
		u.mu.Lock()
		for _, s := range u.kafka {
			all = append(all, s)
		}
		u.mu.Unlock()
	}
	if len(all) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(b.p.ctx, b.p.s.Timeout)
	defer cancel()
	left, err := b.source().Unsettled(ctx, all)
	if err != nil {
		b.p.log.Debug("kafka exactly_once: ask the source which events are settled", "error", err)
		return
	}
	keep := make(map[core.Sent]bool, len(left))
	for _, s := range left {
		keep[s] = true
	}
	for _, s := range all {
		if keep[s] {
			continue
		}
		u := b.units[s.Unit]
		u.mu.Lock()
		if u.kafka[s.ID] == s { // not replaced by a replay's send meanwhile
			delete(u.kafka, s.ID)
		}
		u.mu.Unlock()
	}
}

// partitioner sends events where the plain path's partitioner does, and
// progress records to the partition they name.
type partitioner struct {
	progress string
	hash     sarama.PartitionerConstructor
}

func (p partitioner) ForTopic(topic string) kgo.TopicPartitioner {
	if topic == p.progress {
		return kgo.ManualPartitioner().ForTopic(topic)
	}
	return topicPartitioner{p.hash(topic)}
}

type topicPartitioner struct{ sp sarama.Partitioner }

func (tp topicPartitioner) RequiresConsistency(*kgo.Record) bool { return true }

func (tp topicPartitioner) Partition(r *kgo.Record, n int) int {
	i, err := tp.sp.Partition(&sarama.ProducerMessage{Topic: r.Topic, Key: sarama.ByteEncoder(r.Key)}, int32(n))
	if err != nil {
		return 0
	}
	return int(i)
}

// refusedRecord reports the errors Kafka gives a record it refuses for
// itself, which retrying cannot fix.
func refusedRecord(err error) bool {
	for _, k := range []error{
		kerr.MessageTooLarge, kerr.RecordListTooLarge, kerr.InvalidTopicException, kerr.CorruptMessage,
		kerr.InvalidRecord,
	} {
		if errors.Is(err, k) {
			return true
		}
	}
	return false
}

// classifyTx marks a fenced producer or a transaction another owner
// aborted as undeliverable: the broker is up, another relay holds the
// unit, and the relay must not back off as from a broker that is down.
func classifyTx(err error) error {
	if core.IsPermanent(err) || core.IsUndeliverable(err) {
		return err
	}
	for _, k := range []error{
		kerr.ProducerFenced, kerr.InvalidProducerEpoch, kerr.InvalidProducerIDMapping,
		kerr.ConcurrentTransactions, kerr.TransactionAbortable, kerr.InvalidTxnState,
	} {
		if errors.Is(err, k) {
			return core.Undeliverable(err)
		}
	}
	return err
}

// sanitize replaces the characters Kafka refuses in topic names (and
// that would be odd in a transactional id) with underscores.
func sanitize(name string) string {
	return strings.Map(func(r rune) rune {
		if validChar(r) {
			return r
		}
		return '_'
	}, name)
}

func validChar(r rune) bool {
	return r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-'
}

// checkName reports a name Kafka refuses as a topic.
func checkName(name string) error {
	switch {
	case name == "" || name == "." || name == "..":
		return fmt.Errorf("%q is not a valid Kafka name", name)
	case len(name) > 200:
		return fmt.Errorf("%q is over 200 characters", name)
	}
	for _, r := range name {
		if !validChar(r) {
			return fmt.Errorf("%q has %q: use letters, digits, '.', '_' and '-'", name, r)
		}
	}
	return nil
}

// CheckRelay implements brokers.RelayChecker: exactly_once needs ordered
// relays sharing the table, since each unit must be published by one
// relay at a time (others would fence each other), and a transaction
// timeout the broker does not reach while a publish still waits.
func (s Config) CheckRelay(r brokers.RelaySettings) error {
	if !s.ExactlyOnce {
		return nil
	}
	s = s.withDefaults()
	var errs []error
	if r.Unordered {
		errs = append(errs, errors.New("brokers.kafka.exactly_once needs ordered mode: set relay.unordered to false "+
			"(unordered relays publish the same units and fence each other's transactions)"))
	}
	if !r.Sharing {
		errs = append(errs, errors.New("brokers.kafka.exactly_once needs relay.sharing: without it every relay publishes "+
			"every unit, and their producers fence each other"))
	}
	if s.TransactionTimeout <= r.PublishTimeout+10*time.Second {
		errs = append(errs, fmt.Errorf("brokers.kafka.transaction_timeout %s must exceed relay.publish_timeout %s plus 10s",
			s.TransactionTimeout, r.PublishTimeout))
	}
	return errors.Join(errs...)
}
