package outboxcli

import (
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"reflect"
	"slices"
	"strings"
	"time"

	"github.com/go-viper/mapstructure/v2"
	"github.com/knadh/koanf/parsers/yaml"
	envprovider "github.com/knadh/koanf/providers/env/v2"
	"github.com/knadh/koanf/providers/posflag"
	"github.com/knadh/koanf/providers/structs"
	"github.com/knadh/koanf/v2"
	"github.com/spf13/pflag"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/brokers"
	"github.com/outboxhq/outbox/cmd/outbox/console"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/admin"
	"github.com/outboxhq/outbox/store/logrelay"
)

// Config is the whole configuration of the outbox binary. It is read from
// defaults, a YAML file (--config), environment variables and flags, each
// overriding the one before.
type Config struct {
	DatabaseURL string            `koanf:"database_url"`
	Store       store.Config      `koanf:"store"`
	Broker      string            `koanf:"broker"`
	Brokers     map[string]any    `koanf:"brokers"` // one section per broker, decoded by its adapter
	Routing     brokers.Routing   `koanf:"routing"`
	Relay       RelayConfig       `koanf:"relay"`
	Database    DatabaseConfig    `koanf:"database"`
	Producer    ProducerConfig    `koanf:"producer"`
	Log         LogConfig         `koanf:"log"`
	HTTP        HTTPConfig        `koanf:"http"`
	Retention   RetentionConfig   `koanf:"retention"`
	Tracing     TracingConfig     `koanf:"tracing"`
	Stuck       StuckConfig       `koanf:"stuck"`
	Console     ConsoleConfig     `koanf:"console"`
	CloudEvents CloudEventsConfig `koanf:"cloudevents"`
}

// RelayConfig tunes the relay (see core.Options).
type RelayConfig struct {
	BatchSize       int           `koanf:"batch_size"`
	Lanes           int           `koanf:"lanes"`
	Claimers        int           `koanf:"claimers"`
	PollInterval    time.Duration `koanf:"poll_interval"`
	PublishTimeout  time.Duration `koanf:"publish_timeout"`
	ShutdownTimeout time.Duration `koanf:"shutdown_timeout"`
	// StartupTimeout is how long a starting relay waits for the database
	// (reachable, schema migrated) and the broker before it exits with
	// code 3; 0 waits as long as it takes.
	StartupTimeout time.Duration `koanf:"startup_timeout"`
	Unordered      bool          `koanf:"unordered"`
	Wakeups        bool          `koanf:"wakeups"`
	Sharing        bool          `koanf:"sharing"`
	RetryMin       time.Duration `koanf:"retry_min"`
	RetryMax       time.Duration `koanf:"retry_max"`
	// Mode is where the relay finds events: "table" claims them from the
	// outbox table; "log" reads them from a logical replication slot
	// (rows of the table and log-only messages) and runs the table path
	// only for events handed to the table (see package logrelay).
	Mode string         `koanf:"mode"`
	Log  LogRelayConfig `koanf:"log"`
}

// LogRelayConfig tunes the log relay (see logrelay.Options).
type LogRelayConfig struct {
	Slot             string        `koanf:"slot"`        // default outbox_<schema>_<table>
	Publication      string        `koanf:"publication"` // default: the slot's name
	CreateSlot       bool          `koanf:"create_slot"`
	MaxInFlight      int           `koanf:"max_in_flight"`
	StatusInterval   time.Duration `koanf:"status_interval"`
	ReceiveTimeout   time.Duration `koanf:"receive_timeout"`
	WALSenderTimeout time.Duration `koanf:"wal_sender_timeout"`
	StandbyInterval  time.Duration `koanf:"standby_interval"`
	HandOffAfter     int           `koanf:"handoff_after"`
}

// DatabaseConfig tunes the relay's connection pool.
type DatabaseConfig struct {
	MaxConns int32 `koanf:"max_conns"`
	// IdleInTransactionTimeout makes PostgreSQL end a claim whose relay
	// stopped responding (paused, partitioned), freeing its events for the
	// other replicas. It must exceed the time a batch takes to publish.
	IdleInTransactionTimeout time.Duration `koanf:"idle_in_transaction_timeout"`
}

// ProducerConfig is used by commands that write events (demo).
type ProducerConfig struct {
	MaxPayloadBytes int `koanf:"max_payload_bytes"`
}

// LogConfig selects the log format and level.
type LogConfig struct {
	Format string `koanf:"format"` // text or json
	Level  string `koanf:"level"`  // debug, info, warn, error
}

// HTTPConfig is the relay's HTTP listener for /metrics, /healthz, /readyz.
type HTTPConfig struct {
	Listen string `koanf:"listen"` // empty disables it
}

// RetentionConfig deletes old rows from inside the relay.
type RetentionConfig struct {
	Enabled    bool          `koanf:"enabled"`
	Interval   time.Duration `koanf:"interval"`
	Dispatched time.Duration `koanf:"dispatched"` // keep dispatched events this long
	Processed  time.Duration `koanf:"processed"`  // keep processed_events rows this long
	BatchSize  int           `koanf:"batch_size"`
}

// TracingConfig turns on OpenTelemetry trace propagation.
type TracingConfig struct {
	Enabled bool `koanf:"enabled"`
}

// CloudEventsConfig turns on the CloudEvents binary-mode binding of the
// broker (see brokers.CloudEvents).
type CloudEventsConfig struct {
	Enabled bool   `koanf:"enabled"`
	Source  string `koanf:"source"` // the source attribute; required when enabled
}

// ConsoleConfig is the operator console and its API (package console),
// served on http.listen by `outbox relay` when enabled, and by `outbox
// console`. The credentials belong in the environment
// (OUTBOX_CONSOLE_TOKEN, OUTBOX_CONSOLE_PASSWORD); they are never printed.
type ConsoleConfig struct {
	Enabled        bool          `koanf:"enabled"`
	ReadOnly       bool          `koanf:"read_only"`
	AnonymousReads bool          `koanf:"anonymous_reads"`
	Token          string        `koanf:"token"`
	Username       string        `koanf:"username"`
	Password       string        `koanf:"password"`
	LagSLO         time.Duration `koanf:"lag_slo"`
}

// StuckConfig sets when a pending event counts as stuck.
type StuckConfig struct {
	After time.Duration `koanf:"after"`
}

// Defaults returns the configuration used when nothing overrides it.
// The values come from the library packages that own them.
func Defaults() Config {
	relay, err := core.Options{}.WithDefaults()
	if err != nil {
		panic(err) // the zero Options is valid
	}
	cleanup, err := admin.CleanupOptions{}.WithDefaults()
	if err != nil {
		panic(err)
	}
	logRelay, err := logrelay.Options{}.WithDefaults()
	if err != nil {
		panic(err)
	}
	return Config{
		// No default broker: a relay that names none refuses to start
		// rather than print its events and mark them dispatched.
		// Non-nil maps: the loader merges file and environment into them.
		Brokers: map[string]any{},
		Routing: brokers.Routing{Types: map[string]string{}, Prefixes: map[string]string{}},
		Relay: RelayConfig{
			BatchSize: relay.BatchSize, Lanes: relay.Lanes, Claimers: relay.Claimers,
			PollInterval: relay.PollInterval, PublishTimeout: relay.PublishTimeout,
			ShutdownTimeout: relay.ShutdownTimeout, Wakeups: !relay.DisableWakeups,
			Sharing:        !relay.DisableSharing,
			StartupTimeout: 5 * time.Minute,
			RetryMin:       relay.RetryBackoff.Min, RetryMax: relay.RetryBackoff.Max,
			Mode: "table",
			Log: LogRelayConfig{
				CreateSlot: !logRelay.ManualSlot, MaxInFlight: logRelay.MaxInFlight, StatusInterval: logRelay.StatusInterval,
				ReceiveTimeout: logRelay.ReceiveTimeout, WALSenderTimeout: logRelay.WALSenderTimeout,
				StandbyInterval: logRelay.StandbyInterval, HandOffAfter: logRelay.HandOffAfter,
			},
		},
		Database: DatabaseConfig{MaxConns: 8, IdleInTransactionTimeout: 2 * time.Minute},
		Producer: ProducerConfig{MaxPayloadBytes: outbox.DefaultMaxPayloadBytes},
		Log:      LogConfig{Format: "text", Level: "info"},
		Retention: RetentionConfig{
			Enabled: true, Interval: 10 * time.Minute, Dispatched: cleanup.Dispatched,
			Processed: cleanup.Processed, BatchSize: cleanup.BatchSize,
		},
		Stuck:   StuckConfig{After: store.DefaultStuckAge},
		Console: ConsoleConfig{LagSLO: console.DefaultLagSLO},
	}
}

// Validate checks the values no later stage checks, naming the field.
func (c *Config) Validate() error {
	return errors.Join(slices.Concat(c.validateConnection(), c.validateBroker(), c.validateRelay(), c.validateOperations())...)
}

// problems collects a configuration's errors, each naming its key.
type problems []error

func (p *problems) bad(key, format string, a ...any) {
	*p = append(*p, fmt.Errorf("%s: %s", key, fmt.Sprintf(format, a...)))
}

func (p *problems) add(err error) {
	if err != nil {
		*p = append(*p, err)
	}
}

// validateConnection checks the database URL and the store's names.
func (c *Config) validateConnection() problems {
	var p problems
	if c.DatabaseURL == "" {
		p.bad("database_url", "is empty (set --database-url, DATABASE_URL or database_url in the config file)")
	} else if u, err := url.Parse(c.DatabaseURL); err == nil && u.Scheme != "" && u.Scheme != "postgres" && u.Scheme != "postgresql" {
		p.bad("database_url", "scheme %q is not postgres://", u.Scheme)
	}
	_, err := c.StoreConfig().WithDefaults()
	p.add(err)
	return p
}

// validateBroker checks the broker's name, the routing and the
// CloudEvents binding.
func (c *Config) validateBroker() problems {
	var p problems
	if c.Broker != "" && !brokers.Registered(c.Broker) {
		p.bad("broker", "unknown broker %q (known: %s)", c.Broker, strings.Join(brokers.Names(), ", "))
	}
	p.add(c.Routing.Validate())
	if c.CloudEvents.Enabled {
		p.add(brokers.CloudEvents{Source: c.CloudEvents.Source}.Validate())
	}
	return p
}

// validateRelay checks the relay section and the database settings that
// must fit it. The ranges are core's (core.Options.WithDefaults); the file
// adds that every key has a value, since Defaults fills them all and core
// reads 0 as "the default".
func (c *Config) validateRelay() problems {
	var p problems
	r := c.Relay
	rejected, err := c.rejectedByCore()
	p.add(err)
	for _, k := range relayCounts(r) {
		if k.v < 1 || rejected[k.field] {
			p.bad(k.key, "%d is not between 1 and %d", k.v, k.max)
		}
	}
	if int(c.Database.MaxConns) < r.Claimers+2 {
		p.bad("database.max_conns", "%d is too few: each of relay.claimers %d open claims holds one, and metrics and retention need one more", c.Database.MaxConns, r.Claimers)
	}
	// Core refuses only negative durations, and a retry backoff out of
	// order, which the checks below name by key.
	for _, k := range relayDurations(r) {
		if k.v <= 0 {
			p.bad(k.key, "must be a positive duration such as 500ms or 30s")
		}
	}
	p = append(p, c.validateLogMode()...)
	if r.StartupTimeout < 0 {
		p.bad("relay.startup_timeout", "is negative (0 waits for the database and the broker as long as it takes)")
	}
	if r.RetryMax < r.RetryMin {
		p.bad("relay.retry_max", "%s is less than relay.retry_min %s", r.RetryMax, r.RetryMin)
	}
	if c.Database.IdleInTransactionTimeout < 0 {
		p.bad("database.idle_in_transaction_timeout", "is negative")
	} else if t := c.Database.IdleInTransactionTimeout; t > 0 && t <= r.PublishTimeout {
		p.bad("database.idle_in_transaction_timeout", "%s must exceed relay.publish_timeout %s, or batches would be cut off mid-publish", t, r.PublishTimeout)
	}
	return p
}

// relayKey is a key of the relay section and the core.Options field it
// sets, the field a core.OptionError names.
type relayKey[T any] struct {
	key, field string
	v          T
	max        T // for a count: core's upper bound
}

// relayCounts are the relay section's counts, 1 to core's maximum.
func relayCounts(r RelayConfig) []relayKey[int] {
	return []relayKey[int]{
		{"relay.batch_size", "BatchSize", r.BatchSize, core.MaxBatchSize},
		{"relay.lanes", "Lanes", r.Lanes, core.MaxLanes},
		{"relay.claimers", "Claimers", r.Claimers, core.MaxClaimers},
	}
}

// relayDurations are the relay section's durations, all positive.
func relayDurations(r RelayConfig) []relayKey[time.Duration] {
	return []relayKey[time.Duration]{
		{key: "relay.poll_interval", field: "PollInterval", v: r.PollInterval},
		{key: "relay.publish_timeout", field: "PublishTimeout", v: r.PublishTimeout},
		{key: "relay.shutdown_timeout", field: "ShutdownTimeout", v: r.ShutdownTimeout},
		{key: "relay.retry_min", field: "RetryBackoff", v: r.RetryMin},
		{key: "relay.retry_max", field: "RetryBackoff", v: r.RetryMax},
	}
}

// rejectedByCore returns the core.Options fields core refuses in the relay
// section's options. An error that names no field of the relay section is
// returned as it is.
func (c *Config) rejectedByCore() (map[string]bool, error) {
	known := map[string]bool{}
	for _, k := range relayCounts(c.Relay) {
		known[k.field] = true
	}
	for _, k := range relayDurations(c.Relay) {
		known[k.field] = true
	}
	_, err := c.RelayOptions(nil, nil).WithDefaults()
	errs := []error{err}
	if joined, ok := err.(interface{ Unwrap() []error }); ok {
		errs = joined.Unwrap()
	}
	rejected := map[string]bool{}
	var other []error
	for _, err := range errs {
		var oe *core.OptionError
		if errors.As(err, &oe) && known[oe.Field] {
			rejected[oe.Field] = true
		} else {
			other = append(other, err)
		}
	}
	return rejected, errors.Join(other...)
}

// validateLogMode checks relay.mode and the log relay's settings.
func (c *Config) validateLogMode() problems {
	var p problems
	r := c.Relay
	switch r.Mode {
	case "table":
	case "log":
		if _, err := c.LogRelayOptions(nil, nil).WithDefaults(); err != nil {
			p.bad("relay.log", "%s", strings.TrimPrefix(err.Error(), "log relay options: "))
		}
	default:
		p.bad("relay.mode", "%q is not table or log", r.Mode)
	}
	if r.Log.MaxInFlight < 1 {
		p.bad("relay.log.max_in_flight", "%d is not positive", r.Log.MaxInFlight)
	}
	for _, d := range []struct {
		field string
		v     time.Duration
	}{
		{"relay.log.status_interval", r.Log.StatusInterval}, {"relay.log.receive_timeout", r.Log.ReceiveTimeout},
		{"relay.log.standby_interval", r.Log.StandbyInterval},
	} {
		if d.v <= 0 {
			p.bad(d.field, "must be a positive duration such as 1s")
		}
	}
	return p
}

// validateOperations checks what the relay does besides relaying: the
// producer limit, logging, retention, the stuck age and the console.
func (c *Config) validateOperations() problems {
	var p problems
	if c.Producer.MaxPayloadBytes < 1 {
		p.bad("producer.max_payload_bytes", "%d is not positive", c.Producer.MaxPayloadBytes)
	}
	if c.Log.Format != "text" && c.Log.Format != "json" {
		p.bad("log.format", "%q is not text or json", c.Log.Format)
	}
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(c.Log.Level)); err != nil {
		p.bad("log.level", "%q is not debug, info, warn or error", c.Log.Level)
	}
	if rt := c.Retention; rt.Enabled {
		for _, d := range []struct {
			field string
			v     time.Duration
		}{
			{"retention.interval", rt.Interval}, {"retention.dispatched", rt.Dispatched}, {"retention.processed", rt.Processed},
		} {
			if d.v <= 0 {
				p.bad(d.field, "must be positive")
			}
		}
		if rt.BatchSize < 1 {
			p.bad("retention.batch_size", "%d is not positive", rt.BatchSize)
		}
	}
	if c.Stuck.After <= 0 {
		p.bad("stuck.after", "must be positive")
	}
	p = append(p, c.Console.validate(c.Console.Enabled)...)
	if c.Console.Enabled && c.HTTP.Listen == "" {
		p.bad("console.enabled", "needs http.listen, the address the console is served on")
	}
	return p
}

// ValidateRelay checks, besides Validate, what only `outbox relay` needs: a
// broker named. stdout and gochannel are there for trying outbox, so the
// relay never falls back to one of them.
func (c *Config) ValidateRelay() error {
	if c.Broker == "" {
		return fmt.Errorf("broker: not set: name the broker the relay publishes to with --broker, OUTBOX_BROKER "+
			"or broker in the config file (known: %s; stdout and gochannel only print or keep events in the process)",
			strings.Join(brokers.Names(), ", "))
	}
	return c.checkBrokerFitsRelay()
}

// checkBrokerFitsRelay asks the broker's configuration, when it can say
// (brokers.RelayChecker), whether it works with the relay's settings. A
// section that does not decode is left to the broker's start-up, which
// names the bad key.
func (c *Config) checkBrokerFitsRelay() error {
	t, ok := brokers.ConfigType(c.Broker)
	if !ok {
		return nil
	}
	v := reflect.New(t)
	dc := decoderConfig()
	dc.TagName = "koanf"
	dc.Result = v.Interface()
	dec, err := mapstructure.NewDecoder(dc)
	if err != nil {
		return nil
	}
	if err := dec.Decode(c.Brokers[c.Broker]); err != nil {
		return nil
	}
	rc, ok := v.Elem().Interface().(brokers.RelayChecker)
	if !ok {
		return nil
	}
	return rc.CheckRelay(brokers.RelaySettings{
		Unordered: c.Relay.Unordered, Sharing: c.Relay.Sharing, PublishTimeout: c.Relay.PublishTimeout,
	})
}

// validate checks the console section; checkAccess also when the console
// is served by a command that needs no console.enabled.
func (c ConsoleConfig) validate(checkAccess bool) problems {
	var p problems
	if c.LagSLO <= 0 {
		p.bad("console.lag_slo", "must be positive")
	}
	if !checkAccess {
		return p
	}
	// The lengths are checked, never the values, which stay out of errors.
	if c.Token == "" && c.Username == "" && !c.AnonymousReads {
		p.bad("console", "no credentials: set console.token (OUTBOX_CONSOLE_TOKEN) or console.username and console.password, "+
			"or console.anonymous_reads for a console anyone on the network can read and no one can act in")
	}
	if c.Token != "" && len(c.Token) < consoleMinSecret {
		p.bad("console.token", "is %d bytes; use at least %d random bytes", len(c.Token), consoleMinSecret)
	}
	if (c.Username == "") != (c.Password == "") {
		p.bad("console.username", "and console.password go together")
	}
	if c.Password != "" && len(c.Password) < consoleMinSecret {
		p.bad("console.password", "is %d bytes; use at least %d", len(c.Password), consoleMinSecret)
	}
	return p
}

// consoleMinSecret is the shortest console token or password accepted.
const consoleMinSecret = console.MinSecretBytes

// StoreConfig converts the store section.
func (c *Config) StoreConfig() store.Config {
	return c.Store
}

// RelayOptions converts the relay section.
func (c *Config) RelayOptions(log *slog.Logger, obs core.Observer) core.Options {
	r := c.Relay
	return core.Options{
		BatchSize: r.BatchSize, Lanes: r.Lanes, Claimers: r.Claimers, PollInterval: r.PollInterval,
		PublishTimeout: r.PublishTimeout, ShutdownTimeout: r.ShutdownTimeout,
		Unordered: r.Unordered, DisableWakeups: !r.Wakeups, DisableSharing: !r.Sharing,
		RetryBackoff: core.Backoff{Min: r.RetryMin, Max: r.RetryMax},
		Logger:       log, Observer: obs,
	}
}

// LogRelayOptions converts the relay section for the log relay: the
// engine's options are the table relay's, with the log's own beside them.
func (c *Config) LogRelayOptions(log *slog.Logger, obs core.Observer) logrelay.Options {
	r := c.Relay
	engine := c.RelayOptions(log, obs)
	engine.HandOffAfter = r.Log.HandOffAfter
	return logrelay.Options{
		Store: c.StoreConfig(), Slot: logrelay.Slot{Name: r.Log.Slot, Publication: r.Log.Publication},
		ManualSlot: !r.Log.CreateSlot, Options: engine, MaxInFlight: r.Log.MaxInFlight,
		StatusInterval: r.Log.StatusInterval, ReceiveTimeout: r.Log.ReceiveTimeout,
		WALSenderTimeout: r.Log.WALSenderTimeout, StandbyInterval: r.Log.StandbyInterval,
	}
}

// Loader reads a Config from its sources.
type Loader struct {
	k *koanf.Koanf
}

func decoderConfig() *mapstructure.DecoderConfig {
	return &mapstructure.DecoderConfig{
		DecodeHook: mapstructure.ComposeDecodeHookFunc(
			mapstructure.StringToTimeDurationHookFunc(),
			mapstructure.StringToSliceHookFunc(","),
		),
		WeaklyTypedInput: true,
		ErrorUnused:      true,
	}
}

// flagKeys maps flag names to configuration keys.
var flagKeys = map[string]string{
	"database-url": "database_url",
	"broker":       "broker",
	"schema":       "store.schema",
	"table":        "store.table",
	"batch-size":   "relay.batch_size",
	"lanes":        "relay.lanes",
	"unordered":    "relay.unordered",
	"mode":         "relay.mode",
	"no-wakeups":   "relay.wakeups",
	"http-listen":  "http.listen",
	"log-format":   "log.format",
	"log-level":    "log.level",
}

// AddFlags declares every configuration flag on fs: the global ones and
// the relay's.
func AddFlags(fs *pflag.FlagSet) {
	AddGlobalFlags(fs)
	AddRelayFlags(fs)
}

// AddGlobalFlags declares the flags every command takes: the configuration
// file, the database, the names of the outbox tables and the log.
func AddGlobalFlags(fs *pflag.FlagSet) {
	fs.String("config", "", "YAML configuration file")
	fs.String("database-url", "", "PostgreSQL URL (env DATABASE_URL)")
	fs.String("schema", "", "schema of the outbox tables (default public)")
	fs.String("table", "", "outbox table (default events_outbox)")
	fs.String("log-format", "", "text or json")
	fs.String("log-level", "", "debug, info, warn or error")
}

// AddRelayFlags declares the flags only `outbox relay` takes. Load reads
// whichever of the flags of flagKeys the flag set it is given has.
func AddRelayFlags(fs *pflag.FlagSet) {
	fs.String("broker", "", "broker to publish to, required: "+strings.Join(brokers.Names(), ", ")+" (env OUTBOX_BROKER)")
	fs.Int("batch-size", 0, fmt.Sprintf("events per claim (default %d)", Defaults().Relay.BatchSize))
	fs.Int("lanes", 0, fmt.Sprintf("concurrent publishes (default %d)", Defaults().Relay.Lanes))
	fs.Bool("unordered", false, "drop per-aggregate ordering for throughput")
	fs.String("mode", "", "where events come from: table (claim the outbox table) or log (a logical replication slot)")
	fs.Bool("no-wakeups", false, "poll only, no LISTEN/NOTIFY (for PgBouncer transaction pooling)")
	fs.String("http-listen", "", "address for /metrics, /healthz and /readyz, such as :9090")
}

// Load builds the configuration from defaults, the file named by --config,
// the environment (environ, as from os.Environ) and the flags set in fs,
// which may hold any subset of the flags of AddFlags (a command's own). A
// key the configuration does not have, in the file or as an OUTBOX_
// variable, is an error naming it. Errors are masked (see Redact) with
// the secrets of every source.
func Load(fs *pflag.FlagSet, environ []string) (*Config, *Loader, error) {
	k := koanf.New(".")
	c, err := loadInto(k, fs, environ)
	if err != nil {
		m := &masker{}
		m.add(environSecrets(environ)...)
		m.add(secretsOf(k)...)
		if v, _ := fs.GetString("database-url"); v != "" {
			m.add(dsnSecrets(v)...)
		}
		return nil, nil, m.error(err)
	}
	return c, &Loader{k: k}, nil
}

func loadInto(k *koanf.Koanf, fs *pflag.FlagSet, environ []string) (*Config, error) {
	if err := k.Load(structs.Provider(Defaults(), "koanf"), nil); err != nil {
		return nil, fmt.Errorf("load defaults: %w", err)
	}
	keys := configKeys()
	var keyErrs []error
	if path, _ := fs.GetString("config"); path != "" {
		data, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("config file: %w", err)
		}
		if err := k.Load(bytesProvider(data), yaml.Parser()); err != nil {
			return nil, fmt.Errorf("config file %s: %w", path, err)
		}
		keyErrs = append(keyErrs, checkFileKeys(path, data, keys))
	}
	env := newEnvKeys(keys)
	keyErrs = append(keyErrs, env.check(environ))
	if err := errors.Join(keyErrs...); err != nil {
		return nil, err
	}
	if err := k.Load(envprovider.Provider(".", envprovider.Opt{
		EnvironFunc: func() []string { return environ },
		TransformFunc: func(name, v string) (string, any) {
			key, _ := env.key(name)
			return key, v
		},
	}), nil); err != nil {
		return nil, fmt.Errorf("load environment: %w", err)
	}
	if err := k.Load(posflag.ProviderWithFlag(fs, ".", nil, func(f *pflag.Flag) (string, any) {
		key, ok := flagKeys[f.Name]
		if !ok || !f.Changed {
			return "", nil
		}
		if f.Name == "no-wakeups" {
			return key, f.Value.String() != "true"
		}
		return key, posflag.FlagVal(fs, f)
	}), nil); err != nil {
		return nil, fmt.Errorf("load flags: %w", err)
	}
	var c Config
	if err := k.UnmarshalWithConf("", &c, koanf.UnmarshalConf{DecoderConfig: decoderConfig()}); err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	return &c, nil
}

// bytesProvider hands the configuration file, read once, to koanf.
type bytesProvider []byte

func (b bytesProvider) ReadBytes() ([]byte, error) { return b, nil }

func (b bytesProvider) Read() (map[string]any, error) {
	return nil, errors.New("the configuration file needs a parser")
}

// Section returns the brokers.<name> section as a brokers.Decoder.
func (l *Loader) Section(name string) brokers.Decoder {
	return brokers.DecoderFunc(func(v any) error {
		dc := decoderConfig()
		if err := l.k.UnmarshalWithConf("brokers."+name, v, koanf.UnmarshalConf{DecoderConfig: dc}); err != nil {
			return usagef("brokers.%s: %w", name, err)
		}
		return nil
	})
}
