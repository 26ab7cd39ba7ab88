// Package amqp is the "amqp" broker: Watermill's AMQP publisher for
// RabbitMQ with publisher confirms, persistent messages on durable
// exchanges and queues, and a pool of confirm channels sized to the relay's
// lanes.
//
// A topic maps to an exchange (one per topic, named after it, unless
// Config.Exchange names a single one) and to the routing key. Unless
// Config.Passive is set, the publisher declares, on first use of a topic,
// the durable exchange and a durable queue named after the topic bound with
// the topic as binding key, so no event is dropped for want of a queue.
package amqp

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/brokers/wm"
	"github.com/outboxhq/outbox/core"
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

// New connects (an unreachable broker or refused credentials is an error),
// opens the channel pool and returns a publisher routing with topics.
//
// Watermill's publisher blocks, ignoring contexts, while its broker does not
// answer: in a pooled channel, in a confirm, in Close. So each connection
// is a link of its own (see wm.Open): its sockets are tracked, a publish or
// ping that outlives its deadline aborts them and the next publish
// connects anew, as it does once the connection drops or the pool loses a
// channel. Opening a link, pool included, is bounded by ConnectTimeout.
func New(ctx context.Context, s Config, topics *brokers.Routing, log *slog.Logger) (core.Publisher, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	s = s.withDefaults()
	if log == nil {
		log = slog.New(slog.DiscardHandler) // Watermill's AMQP publisher needs a logger
	}
	uri, redacted, err := s.uri()
	if err != nil {
		return nil, err
	}
	cfg, err := s.connection("outbox relay")
	if err != nil {
		return nil, err
	}
	d := &dialer{s: s, uri: uri, redacted: redacted, cfg: cfg, exchange: s.exchange(), log: log}
	pub, err := wm.Open(ctx, d.dial, topics, classify, wm.Options{
		DialTimeout: s.ConnectTimeout, Broken: linkDown, Logger: log,
	})
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", redacted, err)
	}
	log.Info("amqp publisher ready", "url", redacted, "channels", s.Channels, "exchange", s.Exchange, "passive", s.Passive)
	return pub, nil
}

// dialer opens links: one AMQP connection with its pool of confirm
// channels.
type dialer struct {
	s             Config
	uri, redacted string
	cfg           amqp091.Config
	exchange      wmamqp.ExchangeNameGenerator
	log           *slog.Logger
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
	wcfg := wmamqp.Config{
		Connection: wmamqp.ConnectionConfig{
			AmqpURI: d.uri, AmqpConfig: &cfg,
			// A dropped connection is replaced by a new link, not by
			// Watermill; a short backoff lets its reconnect loop see the
			// close and end soon after.
			Reconnect: &wmamqp.ReconnectConfig{BackoffInitialInterval: 50 * time.Millisecond, BackoffMultiplier: 2, BackoffMaxInterval: time.Second},
		},
		Marshaler: wmamqp.DefaultMarshaler{PostprocessPublishing: properties}, // persistent delivery mode
		Exchange:  wmamqp.ExchangeConfig{GenerateName: d.exchange, Type: d.s.ExchangeType, Durable: true},
		Publish: wmamqp.PublishConfig{
			GenerateRoutingKey: func(topic string) string { return topic },
			ChannelPoolSize:    d.s.Channels,
			ConfirmDelivery:    true,
		},
		TopologyBuilder: declaredAlready{},
	}
	// Connecting and opening the pool take no context: ending ctx closes
	// the sockets under them.
	stop := context.AfterFunc(ctx, socks.Abort)
	defer stop()
	wlog := watermill.NewSlogLogger(d.log)
	conn, err := wmamqp.NewConnection(wcfg.Connection, wlog)
	if err != nil {
		socks.Abort()
		return nil, fmt.Errorf("connect: %w", errors.Join(ctx.Err(), err))
	}
	// Read once, before anything can replace it; the link is this
	// connection and ends with it.
	amqpConn := conn.Connection()
	pub, err := wmamqp.NewPublisherWithConnection(wcfg, wlog, conn)
	if err == nil && ctx.Err() != nil {
		err = ctx.Err()
		_ = pub.Close()
	}
	if err != nil {
		socks.Abort()
		_ = conn.Close()
		return nil, fmt.Errorf("open channel pool: %w", errors.Join(ctx.Err(), err))
	}
	t := &topology{Publisher: pub, wconn: conn, conn: amqpConn, socks: socks, uri: d.uri, cfg: cfg, s: d.s,
		exchange: d.exchange, done: map[string]bool{}}
	return &wm.Link{Publisher: t, Ping: t.ping, Abort: socks.Abort}, nil
}

// properties sets the standard AMQP properties consumers look at first:
// the content type goes in the content-type property, its native place.
func properties(p amqp091.Publishing) amqp091.Publishing {
	p.MessageId, _ = p.Headers[core.HeaderEventID].(string)
	p.Type, _ = p.Headers[core.HeaderType].(string)
	p.ContentType, _ = p.Headers[core.HeaderContentType].(string)
	return p
}

// topology declares a topic's exchange, queue and binding before its first
// publish (or, passive, checks that the exchange exists). It dials a
// connection of its own for that: Watermill's, being replaced while it
// reconnects, is not safe to use from outside. It also tells a link that
// lost its connection from a failed publish.
type topology struct {
	*wmamqp.Publisher
	wconn    *wmamqp.ConnectionWrapper
	conn     *amqp091.Connection // the link's connection, as first opened
	socks    *brokers.Sockets
	uri      string
	cfg      amqp091.Config
	s        Config
	exchange wmamqp.ExchangeNameGenerator

	mu   sync.RWMutex
	done map[string]bool
}

var _ message.Publisher = (*topology)(nil)

// errLinkDown marks errors after which the link is no use: its connection
// closed, or Watermill's pool lost a channel (a channel it could not reopen
// is never returned to the pool; once all are gone every publish blocks).
var errLinkDown = errors.New("amqp connection lost")

func linkDown(err error) bool { return errors.Is(err, errLinkDown) }

func (t *topology) Publish(topic string, msgs ...*message.Message) error {
	if t.conn.IsClosed() {
		return errLinkDown
	}
	if err := t.ensure(topic); err != nil {
		return err
	}
	err := t.Publisher.Publish(topic, msgs...)
	if err != nil && (t.conn.IsClosed() || strings.Contains(err.Error(), "cannot open channel")) {
		return fmt.Errorf("%w: %w", errLinkDown, err)
	}
	return err
}

// ping opens and closes a channel on the link's connection: the broker
// has to answer twice.
func (t *topology) ping(ctx context.Context) error {
	if t.conn.IsClosed() {
		return errLinkDown
	}
	done := make(chan error, 1)
	go func() { // amqp091 calls take no context; a retired link's abort ends this
		ch, err := t.conn.Channel()
		if err == nil {
			err = ch.Close()
		}
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil && t.conn.IsClosed() {
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

// Close closes the channel pool, then the connection. When the link was
// aborted it first waits, briefly, for the library to see the connection
// drop: Watermill's watcher must take that news before Close stops it, or
// the connection's reader blocks forever handing it over.
func (t *topology) Close() error {
	if t.socks.Aborted() {
		for i := 0; i < 100 && !t.conn.IsClosed(); i++ {
			time.Sleep(10 * time.Millisecond)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return errors.Join(t.Publisher.Close(), t.wconn.Close())
}

func (t *topology) ensure(topic string) error {
	t.mu.RLock()
	ok := t.done[topic]
	t.mu.RUnlock()
	if ok {
		return nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.done[topic] {
		return nil
	}
	conn, err := amqp091.DialConfig(t.uri, t.cfg)
	if err != nil {
		return fmt.Errorf("connect to declare topology: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	ex := t.exchange(topic)
	if t.s.Passive {
		if err := ch.ExchangeDeclarePassive(ex, t.s.ExchangeType, true, false, false, false, nil); err != nil {
			return fmt.Errorf("exchange %s: %w", ex, err)
		}
	} else {
		if err := ch.ExchangeDeclare(ex, t.s.ExchangeType, true, false, false, false, nil); err != nil {
			return fmt.Errorf("declare exchange %s: %w", ex, err)
		}
		if _, err := ch.QueueDeclare(topic, true, false, false, false, nil); err != nil {
			return fmt.Errorf("declare queue %s: %w", topic, err)
		}
		if err := ch.QueueBind(topic, topic, ex, false, nil); err != nil {
			return fmt.Errorf("bind queue %s to %s: %w", topic, ex, err)
		}
	}
	t.done[topic] = true
	return nil
}

// declaredAlready leaves Watermill nothing to declare: topology did it.
type declaredAlready struct{}

func (declaredAlready) ExchangeDeclare(*amqp091.Channel, string, wmamqp.Config) error { return nil }

func (declaredAlready) BuildTopology(*amqp091.Channel, wmamqp.BuildTopologyParams, wmamqp.Config, watermill.LoggerAdapter) error {
	return errors.New("amqp: this publisher declares no subscriber topology")
}

// classify marks the errors retrying cannot fix: a message over the
// broker's size limit, a missing exchange (passive), an exchange or queue
// declared with other arguments, no permission on the exchange. A nack is
// transient: RabbitMQ sends one when it cannot take the message now.
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
