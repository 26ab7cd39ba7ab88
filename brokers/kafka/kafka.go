// Package kafka is the "kafka" broker: Watermill's Kafka publisher (Sarama)
// with the idempotent producer and acks from all in-sync replicas, the
// aggregate id as the message key, so one aggregate's events share a
// partition and keep their order.
//
// With exactly_once it publishes instead through franz-go's transactional
// producers, the same records to the same partitions, each batch of a
// unit's events committed together with a record of the unit's progress,
// so read_committed consumers see each event once (see TxPublisher).
package kafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	wmkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/wm"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
)

// CloudEventsBinding is the Kafka binding's: attributes as headers prefixed
// ce_, datacontenttype in the content-type header.
var CloudEventsBinding = brokers.CloudEventsBinding{Prefix: "ce_"}

func init() {
	brokers.RegisterConfig("kafka", New)
	brokers.RegisterCloudEventsBinding("kafka", CloudEventsBinding)
}

// Config configure the Kafka publisher; keys are those of the
// brokers.kafka configuration section (environment: OUTBOX_BROKERS_KAFKA_<KEY>).
type Config struct {
	Brokers  []string `koanf:"brokers"`   // host:port of one or more brokers; required
	ClientID string   `koanf:"client_id"` // default "outbox"
	Version  string   `koanf:"version"`   // protocol version the cluster supports at least; default "2.8.0"
	// Acks is "all" (default: every in-sync replica, with the idempotent
	// producer) or "leader" (faster; a leader failover can lose the event,
	// and the producer is then not idempotent).
	Acks            string        `koanf:"acks"`
	Compression     string        `koanf:"compression"`       // none (default), gzip, snappy, lz4 or zstd
	MaxMessageBytes int           `koanf:"max_message_bytes"` // larger messages fail permanently; default 1000000
	Timeout         time.Duration `koanf:"timeout"`           // broker wait for replica acks; default 10s
	DialTimeout     time.Duration `koanf:"dial_timeout"`      // default 10s
	// Partitioner picks a key's partition: "murmur2" (default; the Java
	// client's, so other producers of the same keys agree) or "fnv" (Sarama's).
	Partitioner string `koanf:"partitioner"`

	TLS                   bool   `koanf:"tls"` // implied by any other tls_ key
	TLSCAFile             string `koanf:"tls_ca_file"`
	TLSCertFile           string `koanf:"tls_cert_file"`
	TLSKeyFile            string `koanf:"tls_key_file"`
	TLSServerName         string `koanf:"tls_server_name"`
	TLSInsecureSkipVerify bool   `koanf:"tls_insecure_skip_verify"`

	SASLMechanism string `koanf:"sasl_mechanism"` // PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512; default none
	SASLUser      string `koanf:"sasl_user"`
	SASLPassword  string `koanf:"sasl_password"`

	// ExactlyOnce publishes through transactional producers (franz-go),
	// each unit's events and its progress record in one Kafka transaction,
	// so read_committed consumers see each event once (see TxPublisher).
	// It needs acks all, and a source that is a core.Settler.
	ExactlyOnce bool `koanf:"exactly_once"`
	// TransactionTimeout is how long the broker lets a transaction stay
	// open before it aborts it, which also bounds how long a frozen
	// relay's open transaction holds back read_committed consumers;
	// default 60s, from 1s to 15m (the broker's default
	// transaction.max.timeout.ms).
	TransactionTimeout time.Duration `koanf:"transaction_timeout"`
	// TransactionalIDPrefix starts each producer's transactional id,
	// <prefix>.<source>.<unit>; default "outbox".
	TransactionalIDPrefix string `koanf:"transactional_id_prefix"`
	// ProgressTopicPrefix starts the name of each source's compacted
	// progress topic, <prefix>.<source>; default "outbox.progress".
	ProgressTopicPrefix string `koanf:"progress_topic_prefix"`
}

// String leaves the password out, so settings can be logged.
func (s Config) String() string {
	pw := ""
	if s.SASLPassword != "" {
		pw = "(set)"
	}
	return fmt.Sprintf("kafka{brokers=%v acks=%s sasl=%s user=%q password=%s tls=%v exactly_once=%v}",
		s.Brokers, s.Acks, s.SASLMechanism, s.SASLUser, pw, s.TLS, s.ExactlyOnce)
}

func (s Config) withDefaults() Config {
	def := func(v *string, d string) {
		if *v == "" {
			*v = d
		}
	}
	def(&s.ClientID, "outbox")
	def(&s.Version, sarama.DefaultVersion.String())
	def(&s.Acks, "all")
	def(&s.Compression, "none")
	def(&s.Partitioner, "murmur2")
	def(&s.TransactionalIDPrefix, "outbox")
	def(&s.ProgressTopicPrefix, "outbox.progress")
	if s.TransactionTimeout == 0 {
		s.TransactionTimeout = DefaultTransactionTimeout
	}
	if s.MaxMessageBytes == 0 {
		s.MaxMessageBytes = 1000000
	}
	if s.Timeout == 0 {
		s.Timeout = 10 * time.Second
	}
	if s.DialTimeout == 0 {
		s.DialTimeout = 10 * time.Second
	}
	if s.TLSCAFile != "" || s.TLSCertFile != "" || s.TLSServerName != "" || s.TLSInsecureSkipVerify {
		s.TLS = true
	}
	return s
}

var compressions = map[string]sarama.CompressionCodec{
	"none": sarama.CompressionNone, "gzip": sarama.CompressionGZIP, "snappy": sarama.CompressionSnappy,
	"lz4": sarama.CompressionLZ4, "zstd": sarama.CompressionZSTD,
}

// Validate reports the first missing or invalid setting, naming its key.
func (s Config) Validate() error {
	s = s.withDefaults()
	if len(s.Brokers) == 0 {
		return errors.New("kafka: brokers is empty")
	}
	for _, b := range s.Brokers {
		if !strings.Contains(b, ":") {
			return fmt.Errorf("kafka: brokers: %q is not host:port", b)
		}
	}
	if _, err := sarama.ParseKafkaVersion(s.Version); err != nil {
		return fmt.Errorf("kafka: version: %w", err)
	}
	if s.Acks != "all" && s.Acks != "leader" {
		return fmt.Errorf("kafka: acks: %q is not all or leader", s.Acks)
	}
	if _, ok := compressions[s.Compression]; !ok {
		return fmt.Errorf("kafka: compression: %q is not none, gzip, snappy, lz4 or zstd", s.Compression)
	}
	if s.Partitioner != "murmur2" && s.Partitioner != "fnv" {
		return fmt.Errorf("kafka: partitioner: %q is not murmur2 or fnv", s.Partitioner)
	}
	switch {
	case s.MaxMessageBytes < 0:
		return errors.New("kafka: max_message_bytes is negative")
	case s.Timeout < 0:
		return errors.New("kafka: timeout is negative")
	case s.DialTimeout < 0:
		return errors.New("kafka: dial_timeout is negative")
	}
	if s.ExactlyOnce && s.Acks != "all" {
		return fmt.Errorf("kafka: exactly_once needs acks all, not %q", s.Acks)
	}
	if s.TransactionTimeout < time.Second || s.TransactionTimeout > MaxTransactionTimeout {
		return fmt.Errorf("kafka: transaction_timeout: %s is not between 1s and %s", s.TransactionTimeout, MaxTransactionTimeout)
	}
	if err := checkName(s.TransactionalIDPrefix); err != nil {
		return fmt.Errorf("kafka: transactional_id_prefix: %w", err)
	}
	if err := checkName(s.ProgressTopicPrefix); err != nil {
		return fmt.Errorf("kafka: progress_topic_prefix: %w", err)
	}
	switch s.SASLMechanism {
	case "":
		if s.SASLUser != "" || s.SASLPassword != "" {
			return errors.New("kafka: sasl_mechanism is empty but sasl_user or sasl_password is set")
		}
	case sarama.SASLTypePlaintext, sarama.SASLTypeSCRAMSHA256, sarama.SASLTypeSCRAMSHA512:
		if s.SASLUser == "" {
			return errors.New("kafka: sasl_user is empty")
		}
		if s.SASLPassword == "" {
			return errors.New("kafka: sasl_password is empty")
		}
	default:
		return fmt.Errorf("kafka: sasl_mechanism: %q is not PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512", s.SASLMechanism)
	}
	return nil
}

// partitioner picks a key's partition on both paths, so the exactly-once
// one sends each event where the plain one would.
func (s Config) partitioner() sarama.PartitionerConstructor {
	if s.Partitioner == "murmur2" {
		return sarama.NewCustomPartitioner(sarama.WithAbsFirst(), sarama.WithCustomHashFunction(newMurmur2))
	}
	return sarama.NewHashPartitioner
}

// marshaler turns Watermill messages into Kafka messages on both paths:
// the aggregate id is the key.
func marshaler() wmkafka.Marshaler {
	return wmkafka.NewWithPartitioningMarshaler(func(_ string, m *message.Message) (string, error) {
		return m.Metadata.Get(event.HeaderAggregateID), nil
	})
}

func (s Config) sarama() (*sarama.Config, error) {
	c := sarama.NewConfig()
	c.ClientID = s.ClientID
	c.Version, _ = sarama.ParseKafkaVersion(s.Version)
	c.Producer.Return.Successes = true // a SyncProducer needs it
	c.Producer.RequiredAcks = sarama.WaitForAll
	c.Producer.Idempotent = true
	c.Net.MaxOpenRequests = 1 // the idempotent producer's condition for ordered retries
	if s.Acks == "leader" {
		c.Producer.RequiredAcks = sarama.WaitForLocal
		c.Producer.Idempotent = false
	}
	c.Producer.Retry.Max = 10
	c.Producer.Compression = compressions[s.Compression]
	c.Producer.MaxMessageBytes = s.MaxMessageBytes
	c.Producer.Timeout = s.Timeout
	c.Producer.Partitioner = s.partitioner()
	c.Net.DialTimeout = s.DialTimeout
	c.Metadata.Retry.Max = 3
	c.Metadata.Retry.Backoff = 250 * time.Millisecond
	c.Metadata.Full = false // only the topics the outbox publishes to
	if s.TLS {
		tc, err := brokers.TLSFiles{CAFile: s.TLSCAFile, CertFile: s.TLSCertFile, KeyFile: s.TLSKeyFile,
			ServerName: s.TLSServerName, InsecureSkipVerify: s.TLSInsecureSkipVerify}.Config()
		if err != nil {
			return nil, fmt.Errorf("kafka: %w", err)
		}
		c.Net.TLS.Enable = true
		c.Net.TLS.Config = tc
	}
	if s.SASLMechanism != "" {
		c.Net.SASL.Enable = true
		c.Net.SASL.Handshake = true
		c.Net.SASL.Mechanism = sarama.SASLMechanism(s.SASLMechanism)
		c.Net.SASL.User = s.SASLUser
		c.Net.SASL.Password = s.SASLPassword
		switch s.SASLMechanism {
		case sarama.SASLTypeSCRAMSHA256:
			c.Net.SASL.SCRAMClientGeneratorFunc = func() sarama.SCRAMClient { return newSCRAM(sha256Hash) }
		case sarama.SASLTypeSCRAMSHA512:
			c.Net.SASL.SCRAMClientGeneratorFunc = func() sarama.SCRAMClient { return newSCRAM(sha512Hash) }
		}
	}
	if err := c.Validate(); err != nil {
		return nil, fmt.Errorf("kafka: %w", err)
	}
	return c, nil
}

// New connects to the cluster (an unreachable one is an error) and returns
// a publisher routing events with topics. With ExactlyOnce it returns a
// *TxPublisher, which the relay binds to its source (core.Binder).
//
// Sarama's calls take no context and retry on their own, each read bounded
// only by its 30s read timeout, so a broker that accepts connections and
// never answers would hold start-up for minutes. Each connection to the
// cluster is therefore a link of its own (see wm.Open): its sockets are
// tracked, opening it is bounded by DialTimeout, and a publish or ping
// that outlives its deadline aborts the sockets and the next publish
// connects anew.
func New(ctx context.Context, s Config, topics *brokers.Routing, log *slog.Logger) (core.Publisher, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	s = s.withDefaults()
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if s.ExactlyOnce {
		return NewTx(ctx, s, topics, log)
	}
	cfg, err := s.sarama()
	if err != nil {
		return nil, err
	}
	d := &dialer{s: s, log: log}
	pub, err := wm.Open(ctx, d.dial, topics, classify, wm.Options{DialTimeout: s.DialTimeout, Broken: linkDown, Logger: log})
	if err != nil {
		return nil, fmt.Errorf("connect to kafka %v: %w", s.Brokers, err)
	}
	log.Info("kafka publisher ready", "brokers", s.Brokers, "acks", s.Acks, "idempotent", cfg.Producer.Idempotent)
	return pub, nil
}

// dialer opens links: a metadata client, which also answers pings, and
// Watermill's producer, over sockets of their own.
type dialer struct {
	s   Config
	log *slog.Logger
}

// sockDialer gives Sarama tracked sockets (it takes a proxy-style dialer).
type sockDialer func(network, addr string) (net.Conn, error)

func (d sockDialer) Dial(network, addr string) (net.Conn, error) { return d(network, addr) }

func (d *dialer) dial(ctx context.Context) (*wm.Link, error) {
	cfg, err := d.s.sarama()
	if err != nil {
		return nil, err
	}
	socks := &brokers.Sockets{}
	timeout, keepAlive := cfg.Net.DialTimeout, cfg.Net.KeepAlive
	cfg.Net.Proxy.Enable = true
	cfg.Net.Proxy.Dialer = sockDialer(socks.Wrap(func(ctx context.Context, network, addr string) (net.Conn, error) {
		nd := net.Dialer{Timeout: timeout, KeepAlive: keepAlive}
		return nd.DialContext(ctx, network, addr)
	}))
	// Once the sockets are aborted, Sarama's retries have nothing to wait
	// for: they fail at once, so an abandoned link ends promptly.
	metaBackoff, prodBackoff := cfg.Metadata.Retry.Backoff, cfg.Producer.Retry.Backoff
	cfg.Metadata.Retry.BackoffFunc = func(int, int) time.Duration {
		if socks.Aborted() {
			return 0
		}
		return metaBackoff
	}
	cfg.Producer.Retry.BackoffFunc = func(int, int) time.Duration {
		if socks.Aborted() {
			return 0
		}
		return prodBackoff
	}
	// Sarama takes no context: ending ctx closes the sockets under it.
	stop := context.AfterFunc(ctx, socks.Abort)
	defer stop()
	fail := func(what string, err error, closers ...func() error) (*wm.Link, error) {
		socks.Abort()
		for _, c := range closers {
			_ = c()
		}
		return nil, fmt.Errorf("%s: %w", what, errors.Join(ctx.Err(), err))
	}
	// Fetching metadata once makes an unreachable cluster or refused
	// credentials fail here, whatever the acks setting.
	client, err := sarama.NewClient(d.s.Brokers, cfg)
	if err != nil {
		return fail("connect", err)
	}
	if err := client.RefreshMetadata(); err != nil {
		return fail("fetch metadata", err, client.Close)
	}
	// Sarama's NewAsyncProducer leaks the client it made when the
	// idempotent producer's first request fails (a broker that does not
	// answer): its metadata updater would outlive every failed dial. With
	// no periodic refresh there is no such goroutine; the producer still
	// fetches metadata for new topics and after leader errors.
	pcfg := *cfg
	pcfg.Metadata.RefreshFrequency = 0
	pub, err := wmkafka.NewPublisher(wmkafka.PublisherConfig{
		Brokers:               d.s.Brokers,
		Marshaler:             marshaler(),
		OverwriteSaramaConfig: &pcfg,
	}, watermill.NewSlogLogger(d.log))
	if err != nil {
		return fail("start producer", err, client.Close)
	}
	if ctx.Err() != nil {
		return fail("start producer", ctx.Err(), pub.Close, client.Close)
	}
	l := &link{Publisher: pub, client: client}
	return &wm.Link{Publisher: l, Ping: l.ping, Abort: socks.Abort}, nil
}

// link is Watermill's producer and the metadata client beside it.
type link struct {
	*wmkafka.Publisher
	client sarama.Client
}

// Close closes the metadata client first: it is the link's own, and a
// producer close that hangs must not keep its updater goroutine alive.
func (l *link) Close() error {
	cerr := l.client.Close()
	return errors.Join(l.Publisher.Close(), cerr)
}

// ping asks one broker for its API versions: the cheapest request every
// broker answers. A broker whose connection failed is closed, so the next
// ping dials it again.
func (l *link) ping(ctx context.Context) error {
	done := make(chan error, 1)
	go func() { // Sarama takes no context; a retired link's abort ends this
		b := l.client.LeastLoadedBroker()
		if b == nil {
			done <- sarama.ErrOutOfBrokers
			return
		}
		if _, err := b.ApiVersions(&sarama.ApiVersionsRequest{}); err != nil {
			_ = b.Close()
			done <- fmt.Errorf("broker %s: %w", b.Addr(), err)
			return
		}
		done <- nil
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// linkDown reports errors after which the producer is no use.
func linkDown(err error) bool {
	return errors.Is(err, sarama.ErrClosedClient) || errors.Is(err, sarama.ErrShuttingDown)
}

// classify marks the errors retrying cannot fix: this message is too large
// or malformed, or the topic name is invalid. The configuration was checked
// at start-up, so a ConfigurationError now is about the message (one over
// max_message_bytes).
func classify(err error) error {
	var cfgErr sarama.ConfigurationError
	if errors.As(err, &cfgErr) {
		return core.Permanent(err)
	}
	for _, k := range []sarama.KError{
		sarama.ErrMessageSizeTooLarge, sarama.ErrInvalidTopic, sarama.ErrInvalidMessage,
		sarama.ErrInvalidRecord, sarama.ErrInvalidMessageSize,
	} {
		if errors.Is(err, k) {
			return core.Permanent(err)
		}
	}
	return err
}

// SubscriberConfig returns the Watermill configuration of the subscriber
// through which one consuming service reads what New publishes, reaching
// the cluster as s does (brokers, version, TLS, SASL; the credentials may
// differ): a consumer group of the service's own, named service, so each
// service gets every event and the service's instances share the
// partitions. A new group starts at the oldest retained event, not at the
// next one, so a service deployed before its first event misses none.
//
// The relay keys every message with its aggregate id, so an aggregate's
// events share a partition; the subscriber hands one partition's messages
// on one at a time, waiting for each ack, and redelivers a nacked message
// before the next. Pass the result to wmkafka.NewSubscriber.
func SubscriberConfig(s Config, service string) (wmkafka.SubscriberConfig, error) {
	if err := s.Validate(); err != nil {
		return wmkafka.SubscriberConfig{}, err
	}
	if err := brokers.CheckService(service); err != nil {
		return wmkafka.SubscriberConfig{}, fmt.Errorf("kafka: %w", err)
	}
	s = s.withDefaults()
	c, err := s.sarama()
	if err != nil {
		return wmkafka.SubscriberConfig{}, err
	}
	c.Consumer.Return.Errors = true // Watermill logs them
	c.Consumer.Offsets.Initial = sarama.OffsetOldest
	// Only committed transactions: what an exactly-once relay aborted
	// (a fenced or crashed owner's) never reaches the handler. Records
	// produced outside transactions are read as before.
	c.Consumer.IsolationLevel = sarama.ReadCommitted
	return wmkafka.SubscriberConfig{
		Brokers:               s.Brokers,
		Unmarshaler:           wmkafka.DefaultMarshaler{},
		ConsumerGroup:         service,
		OverwriteSaramaConfig: c,
	}, nil
}
