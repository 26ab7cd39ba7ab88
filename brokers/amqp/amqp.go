// Package amqp is the "amqp" broker: a RabbitMQ publisher with publisher
// confirms, persistent mandatory messages on durable exchanges, and a pool
// of confirm channels sized to the relay's lanes. Consumers read with
// Watermill's AMQP subscriber (SubscriberConfig).
//
// A topic maps to an exchange (one per topic, named after it, unless
// Config.Exchange names a single one) and to the routing key. Unless
// Config.Passive is set, the publisher declares, on first use of a topic,
// the durable exchange; queues are the consuming services'. A message no
// queue receives comes back from RabbitMQ and its publish fails, so the
// event stays pending in the outbox until a queue is bound, rather than
// being dropped or piling up in a queue nobody reads. Config.TopicQueues
// restores the earlier topology: a durable queue named after each topic.
package amqp

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"sync"
	"time"

	wmamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/wm"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/event"
)

// CloudEventsBinding is the AMQP binding's: attributes as headers prefixed
// cloudEvents_ (RabbitMQ maps 0-9-1 headers to AMQP 1.0 application
// properties, where the binding puts them), datacontenttype in the
// content-type property.
var CloudEventsBinding = brokers.CloudEventsBinding{Prefix: "cloudEvents_"}

func init() {
	brokers.RegisterConfig("amqp", New)
	brokers.RegisterCloudEventsBinding("amqp", CloudEventsBinding)
}

// Config configure the AMQP publisher; keys are those of the
// brokers.amqp configuration section (environment: OUTBOX_BROKERS_AMQP_<KEY>).
type Config struct {
	// URL is amqp://host:port/vhost or amqps://...; required. It may hold
	// the credentials; User and Password, when set, replace them.
	URL      string `koanf:"url"`
	User     string `koanf:"user"`
	Password string `koanf:"password"`
	// Exchange, when set, receives every event with the topic as routing
	// key; by default each topic has its own exchange named after it.
	Exchange     string `koanf:"exchange"`
	ExchangeType string `koanf:"exchange_type"` // default "topic"
	// Passive declares nothing: exchanges (and queues) are managed
	// elsewhere, and a missing exchange fails its events permanently.
	Passive bool `koanf:"passive"`
	// TopicQueues also declares, with each topic's exchange, a durable
	// queue named after the topic and bound with it as binding key, so
	// RabbitMQ keeps every event before any service has a queue. Nobody
	// reads that queue once services have their own: it grows until a
	// policy caps it. Off by default; not with Passive.
	TopicQueues bool `koanf:"topic_queues"`
	// Channels is the size of the pool of confirm channels, the most
	// publishes awaiting a confirm at once; default 256, the relay's lanes.
	Channels       int           `koanf:"channels"`
	ConnectTimeout time.Duration `koanf:"connect_timeout"` // default 10s
	Heartbeat      time.Duration `koanf:"heartbeat"`       // default 10s

	TLSCAFile             string `koanf:"tls_ca_file"` // TLS is on for amqps:// URLs
	TLSCertFile           string `koanf:"tls_cert_file"`
	TLSKeyFile            string `koanf:"tls_key_file"`
	TLSServerName         string `koanf:"tls_server_name"`
	TLSInsecureSkipVerify bool   `koanf:"tls_insecure_skip_verify"`
}

func (s Config) withDefaults() Config {
	if s.ExchangeType == "" {
		s.ExchangeType = "topic"
	}
	if s.Channels == 0 {
		s.Channels = 256
	}
	if s.ConnectTimeout == 0 {
		s.ConnectTimeout = 10 * time.Second
	}
	if s.Heartbeat == 0 {
		s.Heartbeat = 10 * time.Second
	}
	return s
}

// Validate reports the first missing or invalid setting, naming its key.
// Errors never include the URL's password.
func (s Config) Validate() error {
	s = s.withDefaults()
	if s.URL == "" {
		return errors.New("amqp: url is empty")
	}
	u, err := url.Parse(s.URL)
	if err != nil {
		return errors.New("amqp: url is not a valid URL") // the parse error would quote it, password included
	}
	if u.Scheme != "amqp" && u.Scheme != "amqps" {
		return fmt.Errorf("amqp: url: scheme %q is not amqp or amqps", u.Scheme)
	}
	if u.Host == "" {
		return errors.New("amqp: url has no host")
	}
	if s.Password != "" && s.User == "" {
		return errors.New("amqp: password is set but user is empty")
	}
	switch s.ExchangeType {
	case "topic", "direct", "fanout", "headers":
	default:
		return fmt.Errorf("amqp: exchange_type: %q is not topic, direct, fanout or headers", s.ExchangeType)
	}
	if s.TopicQueues && s.Passive {
		return errors.New("amqp: topic_queues: cannot declare queues with passive set")
	}
	switch {
	case s.Channels < 0:
		return errors.New("amqp: channels is negative")
	case s.ConnectTimeout < 0:
		return errors.New("amqp: connect_timeout is negative")
	case s.Heartbeat < 0:
		return errors.New("amqp: heartbeat is negative")
	}
	return nil
}

// uri returns the URL with User and Password applied, and a form safe to log.
func (s Config) uri() (full, redacted string, _ error) {
	u, err := url.Parse(s.URL)
	if err != nil {
		return "", "", errors.New("amqp: url is not a valid URL")
	}
	if s.User != "" {
		u.User = url.UserPassword(s.User, s.Password)
	}
	return u.String(), u.Redacted(), nil
}

// connection is the AMQP connection configuration, TLS included, for a
// connection shown in RabbitMQ's management UI as name.
func (s Config) connection(name string) (amqp091.Config, error) {
	cfg := amqp091.Config{
		Heartbeat:  s.Heartbeat,
		Locale:     "en_US",
		Properties: amqp091.Table{"connection_name": name},
	}
	if tf := (brokers.TLSFiles{CAFile: s.TLSCAFile, CertFile: s.TLSCertFile, KeyFile: s.TLSKeyFile,
		ServerName: s.TLSServerName, InsecureSkipVerify: s.TLSInsecureSkipVerify}); tf != (brokers.TLSFiles{}) {
		var err error
		if cfg.TLSClientConfig, err = tf.Config(); err != nil {
			return cfg, fmt.Errorf("amqp: %w", err)
		}
	}
	return cfg, nil
}

// exchange names a topic's exchange: the topic itself, or Exchange.
func (s Config) exchange() wmamqp.ExchangeNameGenerator {
	if s.Exchange != "" {
		return wmamqp.GenerateExchangeNameConstant(s.Exchange)
	}
	return wmamqp.GenerateExchangeNameTopicName
}

// New connects (an unreachable broker or refused credentials is an error)
// and returns a publisher routing with topics.
//
// Each connection is a link of its own (see wm.Open): its sockets are
// tracked, a publish or ping that outlives its deadline aborts them and the
// next publish connects anew, as it does once the connection drops.
// Connecting is bounded by ConnectTimeout.
func New(ctx context.Context, s Config, topics *brokers.Routing, log *slog.Logger) (core.Publisher, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	s = s.withDefaults()
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	uri, redacted, err := s.uri()
	if err != nil {
		return nil, err
	}
	cfg, err := s.connection("outbox relay")
	if err != nil {
		return nil, err
	}
	d := &dialer{s: s, uri: uri, cfg: cfg, exchange: s.exchange(), log: log}
	pub, err := wm.Open(ctx, d.dial, topics, classify, wm.Options{
		DialTimeout: s.ConnectTimeout, Broken: linkDown, Logger: log,
	})
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", redacted, err)
	}
	log.Info("amqp publisher ready", "url", redacted, "channels", s.Channels, "exchange", s.Exchange,
		"passive", s.Passive, "topic_queues", s.TopicQueues)
	return pub, nil
}

// dialer opens links: one AMQP connection with its pool of confirm
// channels.
type dialer struct {
	s        Config
	uri      string
	cfg      amqp091.Config
	exchange wmamqp.ExchangeNameGenerator
	log      *slog.Logger
}

func (d *dialer) dial(ctx context.Context) (*wm.Link, error) {
	socks := &brokers.Sockets{}
	cfg := d.cfg
	timeout := d.s.ConnectTimeout
	cfg.Dial = socks.Wrap(func(ctx context.Context, network, addr string) (net.Conn, error) {
		nd := net.Dialer{Timeout: timeout}
		c, err := nd.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		// As amqp091's own dialer does: bound the TLS and AMQP handshakes.
		// The library clears the deadline once connected.
		if err := c.SetDeadline(time.Now().Add(timeout)); err != nil {
			_ = c.Close()
			return nil, err
		}
		return c, nil
	})
	// Connecting takes no context: ending ctx closes the sockets under it.
	stop := context.AfterFunc(ctx, socks.Abort)
	defer stop()
	conn, err := amqp091.DialConfig(d.uri, cfg)
	if err == nil && ctx.Err() != nil {
		_ = conn.Close()
		err = ctx.Err()
	}
	if err != nil {
		socks.Abort()
		return nil, fmt.Errorf("connect: %w", errors.Join(ctx.Err(), err))
	}
	l := &link{conn: conn, s: d.s, exchange: d.exchange, log: d.log,
		dead: make(chan struct{}), slots: make(chan struct{}, d.s.Channels), declared: map[string]bool{},
		marshaler: wmamqp.DefaultMarshaler{PostprocessPublishing: properties}} // persistent delivery mode
	closed := conn.NotifyClose(make(chan *amqp091.Error, 1))
	go func() {
		if err := <-closed; err != nil {
			l.log.Info("amqp connection closed", "error", err)
		}
		close(l.dead)
	}()
	return &wm.Link{Publisher: l, Ping: l.ping, Abort: socks.Abort}, nil
}

// properties sets the standard AMQP properties consumers look at first:
// the content type goes in the content-type property, its native place.
func properties(p amqp091.Publishing) amqp091.Publishing {
	p.MessageId, _ = p.Headers[event.HeaderEventID].(string)
	p.Type, _ = p.Headers[event.HeaderType].(string)
	p.ContentType, _ = p.Headers[event.HeaderContentType].(string)
	return p
}

// link publishes on one connection through a pool of confirm channels,
// opened as publishes need them, up to Channels. Every message is
// mandatory: one that no queue receives comes back, and its publish fails.
// It declares a topic's exchange (and, with TopicQueues, its queue) before
// the topic's first publish, or, passive, checks that the exchange exists.
type link struct {
	conn      *amqp091.Connection
	s         Config
	exchange  wmamqp.ExchangeNameGenerator
	marshaler wmamqp.DefaultMarshaler
	log       *slog.Logger
	dead      chan struct{} // closed once the connection is
	slots     chan struct{} // one per channel in use

	mu   sync.Mutex
	idle []*confirmChannel

	topology sync.RWMutex
	declared map[string]bool
}

var _ message.Publisher = (*link)(nil)

// errLinkDown marks errors after which the link is no use: its connection
// closed.
var errLinkDown = errors.New("amqp connection lost")

func linkDown(err error) bool { return errors.Is(err, errLinkDown) }

// ErrNoQueue is the reason of a publish RabbitMQ returned because no queue
// is bound to receive it. It is transient and undeliverable
// (core.IsUndeliverable): the event stays pending and is retried on its
// own backoff until a queue is bound (see Config.TopicQueues).
var ErrNoQueue = errors.New("no queue is bound to receive it")

// down marks err as errLinkDown when the connection has closed.
func (l *link) down(err error) error {
	if err != nil && l.conn.IsClosed() {
		return fmt.Errorf("%w: %w", errLinkDown, err)
	}
	return err
}

// Publish sends msgs on one channel, each once the broker confirmed the
// one before. Waiting for a channel ends with the connection or with the
// first message's context.
func (l *link) Publish(topic string, msgs ...*message.Message) error {
	if l.conn.IsClosed() {
		return errLinkDown
	}
	if len(msgs) == 0 {
		return nil
	}
	if err := l.ensure(topic); err != nil {
		return l.down(err)
	}
	ctx := msgs[0].Context()
	select {
	case l.slots <- struct{}{}:
	case <-l.dead:
		return errLinkDown
	case <-ctx.Done():
		return ctx.Err()
	}
	defer func() { <-l.slots }()
	c, err := l.channel()
	if err != nil {
		return l.down(fmt.Errorf("open channel: %w", err))
	}
	defer l.release(c)
	ex := l.exchange(topic)
	for _, msg := range msgs {
		p, err := l.marshaler.Marshal(msg)
		if err != nil {
			return fmt.Errorf("marshal message %s: %w", msg.UUID, err)
		}
		if err := c.publish(ex, topic, p); err != nil {
			return l.down(err)
		}
	}
	return nil
}

// channel takes an idle channel, or opens one.
func (l *link) channel() (*confirmChannel, error) {
	l.mu.Lock()
	if n := len(l.idle); n > 0 {
		c := l.idle[n-1]
		l.idle = l.idle[:n-1]
		l.mu.Unlock()
		return c, nil
	}
	l.mu.Unlock()
	return openConfirmChannel(l.conn)
}

// release puts c back in the pool unless the broker closed it.
func (l *link) release(c *confirmChannel) {
	if c.ch.IsClosed() {
		return
	}
	l.mu.Lock()
	l.idle = append(l.idle, c)
	l.mu.Unlock()
}

// ping opens and closes a channel on the link's connection: the broker
// has to answer twice.
func (l *link) ping(ctx context.Context) error {
	if l.conn.IsClosed() {
		return errLinkDown
	}
	done := make(chan error, 1)
	go func() { // amqp091 calls take no context; a retired link's abort ends this
		ch, err := l.conn.Channel()
		if err == nil {
			err = ch.Close()
		}
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil && l.conn.IsClosed() {
			return fmt.Errorf("%w: %w", errLinkDown, err)
		}
		if err != nil {
			return fmt.Errorf("open channel: %w", err)
		}
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Close closes the connection, and its channels with it.
func (l *link) Close() error {
	if err := l.conn.Close(); err != nil && !errors.Is(err, amqp091.ErrClosed) {
		return fmt.Errorf("close connection: %w", err)
	}
	return nil
}

// ensure declares topic's topology once per link, on a channel of its
// own: a declaration the broker refuses closes its channel.
func (l *link) ensure(topic string) error {
	l.topology.RLock()
	ok := l.declared[topic]
	l.topology.RUnlock()
	if ok {
		return nil
	}
	l.topology.Lock()
	defer l.topology.Unlock()
	if l.declared[topic] {
		return nil
	}
	ch, err := l.conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel to declare topology: %w", err)
	}
	defer ch.Close()
	ex := l.exchange(topic)
	switch {
	case l.s.Passive:
		if err := ch.ExchangeDeclarePassive(ex, l.s.ExchangeType, true, false, false, false, nil); err != nil {
			return fmt.Errorf("exchange %s: %w", ex, err)
		}
	default:
		if err := ch.ExchangeDeclare(ex, l.s.ExchangeType, true, false, false, false, nil); err != nil {
			return fmt.Errorf("declare exchange %s: %w", ex, err)
		}
	}
	if l.s.TopicQueues {
		if _, err := ch.QueueDeclare(topic, true, false, false, false, nil); err != nil {
			return fmt.Errorf("declare queue %s: %w", topic, err)
		}
		if err := ch.QueueBind(topic, topic, ex, false, nil); err != nil {
			return fmt.Errorf("bind queue %s to %s: %w", topic, ex, err)
		}
	}
	l.declared[topic] = true
	return nil
}

// confirmChannel is a channel in confirm mode that carries one publish at
// a time. RabbitMQ sends a mandatory message's basic.return before its
// basic.ack, and the library hands both over in that order, so once the
// ack is in, a return for that message is already waiting.
type confirmChannel struct {
	ch       *amqp091.Channel
	closed   chan *amqp091.Error
	returns  chan amqp091.Return
	confirms chan amqp091.Confirmation
}

func openConfirmChannel(conn *amqp091.Connection) (*confirmChannel, error) {
	ch, err := conn.Channel()
	if err != nil {
		return nil, err
	}
	if err := ch.Confirm(false); err != nil {
		_ = ch.Close()
		return nil, fmt.Errorf("confirm mode: %w", err)
	}
	// Buffered: the library blocks the connection's reader until each
	// notice is taken, and there is at most one of each in flight.
	return &confirmChannel{
		ch:       ch,
		closed:   ch.NotifyClose(make(chan *amqp091.Error, 1)),
		returns:  ch.NotifyReturn(make(chan amqp091.Return, 1)),
		confirms: ch.NotifyPublish(make(chan amqp091.Confirmation, 1)),
	}, nil
}

// publish sends p as mandatory and waits for the broker's answer.
func (c *confirmChannel) publish(exchange, key string, p amqp091.Publishing) error {
	if err := c.ch.Publish(exchange, key, true, false, p); err != nil {
		return c.why(fmt.Errorf("publish: %w", err))
	}
	conf, ok := <-c.confirms
	if !ok {
		return c.why(errors.New("channel closed before the broker confirmed the message"))
	}
	select {
	case r, ok := <-c.returns:
		if !ok { // closed with the channel: no return came
			break
		}
		return core.Undeliverable(fmt.Errorf("returned by the broker (%d %s): exchange %s, routing key %s: %w; bind a queue to it, or set topic_queues",
			r.ReplyCode, r.ReplyText, r.Exchange, r.RoutingKey, ErrNoQueue))
	default:
	}
	if !conf.Ack {
		return errors.New("the broker nacked the message")
	}
	return nil
}

// why returns the broker's reason when it closed the channel (a missing
// exchange, say), else err.
func (c *confirmChannel) why(err error) error {
	select {
	case e, ok := <-c.closed:
		if ok && e != nil {
			return e
		}
	default:
	}
	return err
}

// classify marks the errors retrying cannot fix: a message over the
// broker's size limit, a missing exchange (passive), an exchange or queue
// declared with other arguments, no permission on the exchange. A nack is
// transient: RabbitMQ sends one when it cannot take the message now. So is
// a returned message: a queue may be bound later.
func classify(err error) error {
	var ae *amqp091.Error
	if errors.As(err, &ae) {
		switch ae.Code {
		case amqp091.ContentTooLarge, amqp091.NotFound, amqp091.PreconditionFailed, amqp091.AccessRefused:
			return core.Permanent(err)
		}
	}
	return err
}

// SubscriberConfig returns the Watermill configuration of the subscriber
// through which one consuming service reads what New publishes with the
// same s (URL and credentials may differ): the same exchange per topic (or
// Exchange) and type, and a durable queue of the service's own,
// "<topic>.<service>", bound with the topic as binding key. Each service
// gets every event; instances of one service share its queue.
//
// The queue is declared with single active consumer: RabbitMQ hands it to
// one instance at a time (another takes over when that one goes), and with
// a prefetch of one that instance holds a single unacknowledged message, so
// a nacked message is redelivered before the next. Together they keep each
// aggregate's events in order; several instances consuming at once would
// not. Pass the result to wmamqp.NewSubscriber.
func SubscriberConfig(s Config, service string) (wmamqp.Config, error) {
	if err := s.Validate(); err != nil {
		return wmamqp.Config{}, err
	}
	if err := brokers.CheckService(service); err != nil {
		return wmamqp.Config{}, fmt.Errorf("amqp: %w", err)
	}
	s = s.withDefaults()
	uri, _, err := s.uri()
	if err != nil {
		return wmamqp.Config{}, err
	}
	conn, err := s.connection("outbox consumer " + service)
	if err != nil {
		return wmamqp.Config{}, err
	}
	return wmamqp.Config{
		Connection: wmamqp.ConnectionConfig{AmqpURI: uri, AmqpConfig: &conn, Reconnect: wmamqp.DefaultReconnectConfig()},
		Marshaler:  wmamqp.DefaultMarshaler{},
		// Declared as the relay declares it, so whichever comes first
		// creates it and the other finds it equal.
		Exchange: wmamqp.ExchangeConfig{GenerateName: s.exchange(), Type: s.ExchangeType, Durable: true},
		Queue: wmamqp.QueueConfig{
			GenerateName: func(topic string) string { return topic + "." + service },
			Durable:      true,
			Arguments:    amqp091.Table{"x-single-active-consumer": true},
		},
		QueueBind:       wmamqp.QueueBindConfig{GenerateRoutingKey: func(topic string) string { return topic }},
		Consume:         wmamqp.ConsumeConfig{Qos: wmamqp.QosConfig{PrefetchCount: 1}},
		TopologyBuilder: &wmamqp.DefaultTopologyBuilder{},
	}, nil
}
