// Package googlecloud is the "googlecloud" broker: Watermill's Google Cloud
// Pub/Sub publisher with message ordering on, the aggregate id as ordering
// key, and publishing resumed for a key after a failed publish.
//
// The client library's default batching waits up to 10ms to fill a batch of
// 100; a relay publishing one event at a time per lane then manages about
// 100 events per second. The defaults here send each message at once.
package googlecloud

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	//lint:ignore SA1019 watermill-googlecloud v1.2.1 is built on pubsub v1, whose types it takes
	"cloud.google.com/go/pubsub"
	"github.com/ThreeDotsLabs/watermill"
	wmgc "github.com/ThreeDotsLabs/watermill-googlecloud/pkg/googlecloud"
	"github.com/ThreeDotsLabs/watermill/message"
	"google.golang.org/api/iterator"
	"google.golang.org/api/option"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/wm"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
)

// CloudEventsBinding is the Google Cloud Pub/Sub binding's: lower-case
// attributes prefixed ce-; receivers take datacontenttype from the
// content-type attribute, which every event carries.
var CloudEventsBinding = brokers.CloudEventsBinding{Prefix: "ce-"}

func init() {
	brokers.RegisterConfig("googlecloud", New)
	brokers.RegisterCloudEventsBinding("googlecloud", CloudEventsBinding)
}

// Config configure the Pub/Sub publisher; keys are those of the
// brokers.googlecloud configuration section (environment:
// OUTBOX_BROKERS_GOOGLECLOUD_<KEY>).
type Config struct {
	ProjectID string `koanf:"project_id"` // required
	// CredentialsFile is a service account key file; by default the
	// client finds credentials itself (GOOGLE_APPLICATION_CREDENTIALS,
	// the metadata server).
	CredentialsFile string `koanf:"credentials_file"`
	// EmulatorHost is the host:port of a Pub/Sub emulator, reached without
	// TLS or credentials. The client also honours PUBSUB_EMULATOR_HOST.
	EmulatorHost string `koanf:"emulator_host"`
	Endpoint     string `koanf:"endpoint"` // overrides the service endpoint, such as a regional one
	// CreateTopics creates a missing topic on first use. By default a
	// missing topic fails its events permanently (topics are provisioned
	// with their subscriptions; a message on a topic without subscriptions
	// is lost).
	CreateTopics bool `koanf:"create_topics"`

	DelayThreshold time.Duration `koanf:"delay_threshold"` // longest wait to fill a batch; default 50us
	CountThreshold int           `koanf:"count_threshold"` // messages that send a batch at once; default 1
	ByteThreshold  int           `koanf:"byte_threshold"`  // bytes that send a batch at once; default 1000000
	PublishTimeout time.Duration `koanf:"publish_timeout"` // bound on one publish; default 10s
	ConnectTimeout time.Duration `koanf:"connect_timeout"` // default 10s
}

func (s Config) withDefaults() Config {
	if s.DelayThreshold == 0 {
		s.DelayThreshold = 50 * time.Microsecond
	}
	if s.CountThreshold == 0 {
		s.CountThreshold = 1
	}
	if s.ByteThreshold == 0 {
		s.ByteThreshold = 1e6
	}
	if s.PublishTimeout == 0 {
		s.PublishTimeout = 10 * time.Second
	}
	if s.ConnectTimeout == 0 {
		s.ConnectTimeout = 10 * time.Second
	}
	return s
}

// Validate reports the first missing or invalid setting, naming its key.
func (s Config) Validate() error {
	switch {
	case s.ProjectID == "":
		return errors.New("googlecloud: project_id is empty")
	case s.EmulatorHost != "" && s.CredentialsFile != "":
		return errors.New("googlecloud: emulator_host and credentials_file exclude each other")
	case s.EmulatorHost != "" && s.Endpoint != "":
		return errors.New("googlecloud: emulator_host and endpoint exclude each other")
	case s.DelayThreshold < 0:
		return errors.New("googlecloud: delay_threshold is negative")
	case s.CountThreshold < 0:
		return errors.New("googlecloud: count_threshold is negative")
	case s.ByteThreshold < 0:
		return errors.New("googlecloud: byte_threshold is negative")
	case s.PublishTimeout < 0:
		return errors.New("googlecloud: publish_timeout is negative")
	case s.ConnectTimeout < 0:
		return errors.New("googlecloud: connect_timeout is negative")
	}
	return nil
}

func (s Config) clientOptions() []option.ClientOption {
	var o []option.ClientOption
	if s.EmulatorHost != "" {
		o = append(o, option.WithEndpoint(s.EmulatorHost), option.WithoutAuthentication(),
			option.WithGRPCDialOption(grpc.WithTransportCredentials(insecure.NewCredentials())),
			option.WithTelemetryDisabled())
	}
	if s.Endpoint != "" {
		o = append(o, option.WithEndpoint(s.Endpoint))
	}
	if s.CredentialsFile != "" {
		o = append(o, option.WithAuthCredentialsFile(option.ServiceAccount, s.CredentialsFile))
	}
	return o
}

// New creates the client and returns a publisher routing with topics. The
// client connects lazily: an unreachable endpoint shows on the first
// publish or ping. Each client is a link (see wm.Open): creating it is
// bounded by ConnectTimeout, its sockets are tracked, and a publish or
// ping that outlives its deadline aborts them and the next publish creates
// a new client.
func New(ctx context.Context, s Config, topics *brokers.Routing, log *slog.Logger) (core.Publisher, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	s = s.withDefaults()
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	d := &dialer{s: s, log: log}
	pub, err := wm.Open(ctx, d.dial, topics, classify, wm.Options{DialTimeout: s.ConnectTimeout, Logger: log})
	if err != nil {
		return nil, fmt.Errorf("create pubsub client for project %s: %w", s.ProjectID, err)
	}
	log.Info("googlecloud publisher ready", "project_id", s.ProjectID, "emulator", s.EmulatorHost != "",
		"delay_threshold", s.DelayThreshold, "count_threshold", s.CountThreshold)
	return pub, nil
}

type dialer struct {
	s   Config
	log *slog.Logger
}

func (d *dialer) dial(ctx context.Context) (*wm.Link, error) {
	s := d.s
	socks := &brokers.Sockets{}
	tcp := socks.Wrap(func(ctx context.Context, network, addr string) (net.Conn, error) {
		nd := net.Dialer{Timeout: s.ConnectTimeout}
		return nd.DialContext(ctx, network, addr)
	})
	opts := append(s.clientOptions(), option.WithGRPCDialOption(grpc.WithContextDialer(
		func(_ context.Context, addr string) (net.Conn, error) { return tcp("tcp", addr) })))
	ps := pubsub.DefaultPublishSettings
	ps.DelayThreshold = s.DelayThreshold
	ps.CountThreshold = s.CountThreshold
	ps.ByteThreshold = s.ByteThreshold
	ps.Timeout = s.PublishTimeout
	stop := context.AfterFunc(ctx, socks.Abort)
	defer stop()
	pub, err := wmgc.NewPublisher(wmgc.PublisherConfig{
		ProjectID: s.ProjectID,
		// The link checks topics itself, with a context its abort ends:
		// Watermill checks under a lock, with a context of its own.
		DoNotCheckTopicExistence:  true,
		DoNotCreateTopicIfMissing: true,
		EnableMessageOrdering:     true,
		// A failed publish pauses its ordering key; resume it so the
		// relay's retry can go out.
		EnableMessageOrderingAutoResumePublishOnError: true,
		ConnectTimeout:  s.ConnectTimeout,
		PublishTimeout:  s.PublishTimeout,
		PublishSettings: &ps,
		ClientOptions:   opts,
		Marshaler: wmgc.NewOrderingMarshaler(func(_ string, m *message.Message) (string, error) {
			return m.Metadata.Get(event.HeaderAggregateID), nil
		}),
	}, watermill.NewSlogLogger(d.log))
	if err != nil {
		socks.Abort()
		return nil, err
	}
	// A client of our own, for pings and topic checks.
	c, err := pubsub.NewClient(ctx, s.ProjectID, opts...)
	if err != nil {
		socks.Abort()
		_ = pub.Close()
		return nil, err
	}
	lctx, cancel := context.WithCancel(context.Background())
	l := &link{Publisher: pub, client: c, ctx: lctx, timeout: s.PublishTimeout, create: s.CreateTopics, known: map[string]bool{}}
	abort := func() { cancel(); socks.Abort() }
	return &wm.Link{Publisher: l, Ping: l.ping, Abort: abort}, nil
}

// link is Watermill's publisher and a client of ours beside it, which
// checks each topic before its first publish (and creates it, with
// create_topics: Watermill can create topics too, but a topic it creates
// loses the publish settings, back to the slow default batching).
type link struct {
	message.Publisher
	client  *pubsub.Client
	ctx     context.Context // ends with the link's abort
	timeout time.Duration
	create  bool

	mu    sync.Mutex // held while checking a topic
	known map[string]bool
	last  atomic.Value // string: a topic published to, for pings
}

var _ message.Publisher = (*link)(nil)

func (l *link) Publish(topic string, msgs ...*message.Message) error {
	if err := l.ensure(topic); err != nil {
		return err
	}
	if err := l.Publisher.Publish(topic, msgs...); err != nil {
		return err
	}
	l.last.Store(topic)
	return nil
}

func (l *link) ensure(topic string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.known[topic] {
		return nil
	}
	ctx, cancel := context.WithTimeout(l.ctx, l.timeout)
	defer cancel()
	ok, err := l.client.Topic(topic).Exists(ctx)
	if err != nil {
		return fmt.Errorf("check topic %s: %w", topic, err)
	}
	if !ok {
		if !l.create {
			return fmt.Errorf("%s: %w", topic, wmgc.ErrTopicDoesNotExist)
		}
		if _, err := l.client.CreateTopic(ctx, topic); err != nil && status.Code(err) != codes.AlreadyExists {
			return fmt.Errorf("create topic %s: %w", topic, err)
		}
	}
	l.known[topic] = true
	return nil
}

func (l *link) Close() error { return errors.Join(l.Publisher.Close(), l.client.Close()) }

// ping checks that the last topic published to still exists or, before
// any publish, lists one topic. A refusal for want of permission is an
// answer: the service is there.
func (l *link) ping(ctx context.Context) error {
	topic, _ := l.last.Load().(string)
	var err error
	if topic != "" {
		_, err = l.client.Topic(topic).Exists(ctx)
	} else if _, err = l.client.Topics(ctx).Next(); errors.Is(err, iterator.Done) {
		err = nil
	}
	if status.Code(err) == codes.PermissionDenied {
		return nil
	}
	return err
}

// classify marks the errors retrying cannot fix: a message the service
// refuses as invalid or too large, a topic that does not exist.
func classify(err error) error {
	if errors.Is(err, pubsub.ErrOversizedMessage) || errors.Is(err, wmgc.ErrTopicDoesNotExist) {
		return core.Permanent(err)
	}
	switch status.Code(err) { // finds a gRPC status wrapped anywhere in err
	case codes.InvalidArgument, codes.NotFound:
		return core.Permanent(err)
	}
	return err
}

// SubscriberConfig returns the Watermill configuration of the subscriber
// through which one consuming service reads what New publishes, reaching
// Pub/Sub as s does (project, emulator or endpoint, credentials file): a
// subscription of the service's own, "<topic>.<service>", created on first
// use with message ordering enabled, so each service gets every event, the
// service's instances share its messages, and each aggregate's events (the
// relay's ordering key) arrive in order, one at a time per key. A missing
// topic is created only when s.CreateTopics is set, as the relay does.
//
// Message ordering cannot be turned on for an existing subscription: one
// created without it must be replaced. Messages published before a
// subscription exists never reach it, so start each service (or create its
// subscription) before the relay publishes its topic. Pass the result to
// wmgc.NewSubscriber.
func SubscriberConfig(s Config, service string) (wmgc.SubscriberConfig, error) {
	if err := s.Validate(); err != nil {
		return wmgc.SubscriberConfig{}, err
	}
	if err := brokers.CheckService(service); err != nil {
		return wmgc.SubscriberConfig{}, fmt.Errorf("googlecloud: %w", err)
	}
	s = s.withDefaults()
	return wmgc.SubscriberConfig{
		ProjectID:                 s.ProjectID,
		GenerateSubscriptionName:  wmgc.TopicSubscriptionNameWithSuffix("." + service),
		SubscriptionConfig:        pubsub.SubscriptionConfig{EnableMessageOrdering: true},
		DoNotCreateTopicIfMissing: !s.CreateTopics,
		ConnectTimeout:            s.ConnectTimeout,
		ClientOptions:             s.clientOptions(),
		Unmarshaler:               wmgc.DefaultMarshalerUnmarshaler{},
	}, nil
}
