// Package brokers is the registry of publishers the relay can use, chosen
// by name in configuration, in the manner of database/sql drivers: each
// adapter package registers a Factory in its init function, and a binary
// selects one with Open. Users register their own the same way.
//
// It also holds the topic routing rules shared by every adapter.
package brokers

import (
	"context"
	"fmt"
	"log/slog"
	"reflect"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/outboxhq/outbox/core"
)

// Decoder decodes a broker's own configuration section into v, a pointer to
// the adapter's Config struct. Unknown keys are an error.
type Decoder interface {
	Decode(v any) error
}

// Options is what a Factory receives.
type Options struct {
	Config Decoder      // the broker's section of the configuration
	Topics *Routing     // resolves each event's topic
	Logger *slog.Logger // never nil
}

// Factory builds a publisher. It checks its configuration and returns an error
// naming the bad field; it should connect, so an unreachable broker is
// reported at start-up.
type Factory func(ctx context.Context, p Options) (core.Publisher, error)

var (
	mu        sync.RWMutex
	factories = map[string]Factory{}
	configs   = map[string]reflect.Type{} // of brokers registered with RegisterConfig
)

// Register makes a publisher available under name. It panics when name is
// empty or taken, or f is nil, as these are programming errors.
func Register(name string, f Factory) {
	mu.Lock()
	defer mu.Unlock()
	if name == "" || f == nil {
		panic("brokers: Register needs a name and a factory")
	}
	if _, dup := factories[name]; dup {
		panic("brokers: Register called twice for " + name)
	}
	factories[name] = f
}

// RegisterConfig registers a publisher configured by the struct S: its
// factory decodes the broker's section into S and calls open, which checks
// the configuration and connects.
func RegisterConfig[S any](name string, open func(ctx context.Context, s S, topics *Routing, log *slog.Logger) (core.Publisher, error)) {
	Register(name, func(ctx context.Context, p Options) (core.Publisher, error) {
		var s S
		if err := p.Config.Decode(&s); err != nil {
			return nil, fmt.Errorf("%s config: %w", name, err)
		}
		return open(ctx, s, p.Topics, p.Logger)
	})
	mu.Lock()
	configs[name] = reflect.TypeFor[S]()
	mu.Unlock()
}

// ConfigType returns the configuration type a publisher was registered
// with by RegisterConfig, so a configuration loader can check the keys of its
// section before it is opened. ok is false for one registered with
// Register, whose keys only its Factory knows.
func ConfigType(name string) (t reflect.Type, ok bool) {
	mu.RLock()
	defer mu.RUnlock()
	t, ok = configs[name]
	return t, ok
}

// Names lists the registered publishers, sorted.
func Names() []string {
	mu.RLock()
	defer mu.RUnlock()
	names := make([]string, 0, len(factories))
	for n := range factories {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// Open builds the publisher registered as name.
func Open(ctx context.Context, name string, p Options) (core.Publisher, error) {
	mu.RLock()
	f, ok := factories[name]
	mu.RUnlock()
	if !ok {
		return nil, fmt.Errorf("broker %q is not registered (known: %v)", name, Names())
	}
	if p.Logger == nil {
		p.Logger = slog.New(slog.DiscardHandler)
	}
	if p.Topics == nil {
		p.Topics = &Routing{}
	}
	if p.Config == nil {
		p.Config = emptyDecoder{}
	}
	pub, err := f(ctx, p)
	if err != nil {
		return nil, fmt.Errorf("open broker %s: %w", name, err)
	}
	return pub, nil
}

type emptyDecoder struct{}

var _ Decoder = emptyDecoder{}

func (emptyDecoder) Decode(any) error { return nil }

// Registered reports whether name is registered.
func Registered(name string) bool { return slices.Contains(Names(), name) }

// DecoderFunc adapts a function to Decoder, for tests and for binaries that
// configure brokers without the CLI's configuration loader.
type DecoderFunc func(v any) error

var _ Decoder = DecoderFunc(nil)

// Decode implements Decoder.
func (f DecoderFunc) Decode(v any) error { return f(v) }

// RelaySettings are the relay's settings a broker's configuration may
// depend on.
type RelaySettings struct {
	Unordered      bool          // relay.unordered
	Sharing        bool          // relay.sharing
	PublishTimeout time.Duration // relay.publish_timeout
}

// RelayChecker is an optional capability of a broker's configuration
// type (see RegisterConfig): CheckRelay reports the relay settings the
// configuration cannot work with, each error naming the keys, so the
// relay refuses to start with them.
type RelayChecker interface {
	CheckRelay(r RelaySettings) error
}
