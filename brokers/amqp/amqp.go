// Package amqp is the "amqp" broker: Watermill's AMQP publisher for
// RabbitMQ with publisher confirms, persistent messages on durable
// exchanges and queues, and a pool of confirm channels sized to the relay's
// lanes.
//
// A topic maps to an exchange (one per topic, named after it, unless
// Settings.Exchange names a single one) and to the routing key. Unless
// Settings.Passive is set, the publisher declares, on first use of a topic,
// the durable exchange and a durable queue named after the topic bound with
// the topic as binding key, so no event is dropped for want of a queue.
package amqp

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
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

func init() { brokers.RegisterSettings("amqp", New) }

// Settings configure the AMQP publisher; keys are those of the
// brokers.amqp configuration section (environment: OUTBOX_BROKERS_AMQP_<KEY>).
type Settings struct {
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
	// publishes awaiting a confirm at once; default 16, the relay's lanes.
	Channels       int           `koanf:"channels"`
	ConnectTimeout time.Duration `koanf:"connect_timeout"` // default 10s
	Heartbeat      time.Duration `koanf:"heartbeat"`       // default 10s

	TLSCAFile             string `koanf:"tls_ca_file"` // TLS is on for amqps:// URLs
	TLSCertFile           string `koanf:"tls_cert_file"`
	TLSKeyFile            string `koanf:"tls_key_file"`
	TLSServerName         string `koanf:"tls_server_name"`
	TLSInsecureSkipVerify bool   `koanf:"tls_insecure_skip_verify"`
}

func (s Settings) withDefaults() Settings {
	if s.ExchangeType == "" {
		s.ExchangeType = "topic"
	}
	if s.Channels == 0 {
		s.Channels = 16
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
func (s Settings) Validate() error {
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
func (s Settings) uri() (full, redacted string, _ error) {
	u, err := url.Parse(s.URL)
	if err != nil {
		return "", "", errors.New("amqp: url is not a valid URL")
	}
	if s.User != "" {
		u.User = url.UserPassword(s.User, s.Password)
	}
	return u.String(), u.Redacted(), nil
}

// New connects (an unreachable broker or refused credentials is an error),
// opens the channel pool and returns a publisher routing with topics.
func New(ctx context.Context, s Settings, topics *brokers.Routing, log *slog.Logger) (core.Publisher, error) {
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
	cfg := amqp091.Config{
		Heartbeat:  s.Heartbeat,
		Locale:     "en_US",
		Dial:       amqp091.DefaultDial(s.ConnectTimeout),
		Properties: amqp091.Table{"connection_name": "outbox relay"},
	}
	if tf := (brokers.TLSFiles{CAFile: s.TLSCAFile, CertFile: s.TLSCertFile, KeyFile: s.TLSKeyFile,
		ServerName: s.TLSServerName, InsecureSkipVerify: s.TLSInsecureSkipVerify}); tf != (brokers.TLSFiles{}) {
		if cfg.TLSClientConfig, err = tf.Config(); err != nil {
			return nil, fmt.Errorf("amqp: %w", err)
		}
	}
	exchange := wmamqp.GenerateExchangeNameTopicName
	if s.Exchange != "" {
		exchange = wmamqp.GenerateExchangeNameConstant(s.Exchange)
	}
	wcfg := wmamqp.Config{
		Connection: wmamqp.ConnectionConfig{AmqpURI: uri, AmqpConfig: &cfg},
		Marshaler:  wmamqp.DefaultMarshaler{PostprocessPublishing: properties}, // persistent delivery mode
		Exchange:   wmamqp.ExchangeConfig{GenerateName: exchange, Type: s.ExchangeType, Durable: true},
		Publish: wmamqp.PublishConfig{
			GenerateRoutingKey: func(topic string) string { return topic },
			ChannelPoolSize:    s.Channels,
			ConfirmDelivery:    true,
		},
		TopologyBuilder: declaredAlready{},
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	pub, err := wmamqp.NewPublisher(wcfg, watermill.NewSlogLogger(log))
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", redacted, err)
	}
	log.Info("amqp publisher ready", "url", redacted, "channels", s.Channels, "exchange", s.Exchange, "passive", s.Passive)
	t := &topology{Publisher: pub, uri: uri, cfg: cfg, s: s, exchange: exchange, done: map[string]bool{}}
	return wm.New(wm.Guard(t), topics, classify), nil
}

// properties sets the standard AMQP properties consumers look at first.
func properties(p amqp091.Publishing) amqp091.Publishing {
	p.MessageId, _ = p.Headers[core.HeaderEventUID].(string)
	p.Type, _ = p.Headers[core.HeaderType].(string)
	p.ContentType = "application/json"
	return p
}

// topology declares a topic's exchange, queue and binding before its first
// publish (or, passive, checks that the exchange exists). It dials a
// connection of its own for that: Watermill's, being replaced while it
// reconnects, is not safe to use from outside.
type topology struct {
	message.Publisher
	uri      string
	cfg      amqp091.Config
	s        Settings
	exchange wmamqp.ExchangeNameGenerator

	mu   sync.RWMutex
	done map[string]bool
}

var _ message.Publisher = (*topology)(nil)

func (t *topology) Publish(topic string, msgs ...*message.Message) error {
	if err := t.ensure(topic); err != nil {
		return err
	}
	return t.Publisher.Publish(topic, msgs...)
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
