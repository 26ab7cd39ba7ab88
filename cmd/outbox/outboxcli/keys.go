package outboxcli

import (
	"encoding"
	"errors"
	"fmt"
	"reflect"
	"sort"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/outboxhq/outbox/brokers"
)

// keyNode is one level of the configuration's key tree, built from the
// koanf tags of Config and of each broker's Config type.
type keyNode struct {
	children map[string]*keyNode // nil for a value
	open     bool                // a map whose keys are data (routing.types), or a section only its broker checks
}

var textUnmarshaler = reflect.TypeFor[encoding.TextUnmarshaler]()

// typeKeys builds the key tree of the configuration type t, as the loader's
// decoder (mapstructure with koanf tags) sees it.
func typeKeys(t reflect.Type) *keyNode {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch {
	case t.Kind() == reflect.Map:
		return &keyNode{open: true}
	case t.Kind() != reflect.Struct, t == reflect.TypeFor[time.Time](), reflect.PointerTo(t).Implements(textUnmarshaler):
		return &keyNode{}
	}
	n := &keyNode{children: map[string]*keyNode{}}
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		name, opts, _ := strings.Cut(f.Tag.Get("koanf"), ",")
		if name == "-" {
			continue
		}
		if strings.Contains(opts, "squash") {
			for k, v := range typeKeys(f.Type).children {
				n.children[k] = v
			}
			continue
		}
		if name == "" {
			name = strings.ToLower(f.Name)
		}
		n.children[name] = typeKeys(f.Type)
	}
	return n
}

// configKeys is the key tree of Config with a section for each registered
// broker: checked when the broker was registered with its Config type,
// open otherwise.
func configKeys() *keyNode {
	root := typeKeys(reflect.TypeFor[Config]())
	bs := &keyNode{children: map[string]*keyNode{}}
	for _, name := range brokers.Names() {
		if t, ok := brokers.ConfigType(name); ok {
			bs.children[name] = typeKeys(t)
		} else {
			bs.children[name] = &keyNode{open: true}
		}
	}
	root.children["brokers"] = bs
	return root
}

// paths lists the dotted paths of every section and value under n.
func (n *keyNode) paths(prefix string) []string {
	var out []string
	for k, c := range n.children {
		p := k
		if prefix != "" {
			p = prefix + "." + k
		}
		out = append(out, p)
		out = append(out, c.paths(p)...)
	}
	return out
}

// KnownKeys lists every configuration key, sorted: the values that can be
// set, not the sections that hold them, with each registered broker's
// keys (brokers.kafka.sasl_password); a broker registered without a
// Config type is listed as its section, whose keys are not checked.
func KnownKeys() []string {
	root := configKeys()
	var keys []string
	for _, p := range root.paths("") {
		if n := root.lookup(p); n != nil && n.children == nil {
			keys = append(keys, p)
		}
	}
	sort.Strings(keys)
	return keys
}

func (n *keyNode) lookup(path string) *keyNode {
	for part := range strings.SplitSeq(path, ".") {
		if n.children == nil {
			return nil
		}
		if n = n.children[part]; n == nil {
			return nil
		}
	}
	return n
}

// editDistance is the Levenshtein distance between a and b, in bytes.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

// closest returns the candidate nearest to s, or "" when none is close
// enough to be the one meant: within a third of the longer length, so a
// typo is caught and an unrelated name gets no odd suggestion.
func closest(s string, candidates []string) string {
	best, bestD := "", -1
	for _, c := range candidates {
		d := editDistance(s, c)
		if bestD < 0 || d < bestD || (d == bestD && c < best) {
			best, bestD = c, d
		}
	}
	if bestD < 0 || 3*bestD > max(len(s), len(best)) {
		return ""
	}
	return best
}

func didYouMean(s string) string {
	if s == "" {
		return ""
	}
	return " (did you mean " + s + "?)"
}

// envExemptPrefixes are OUTBOX_ variables that are not configuration, so
// the loader leaves them alone: OUTBOX_TEST_ for anything the test suite and
// scripts/services.sh use, and the knobs of the repository's own scripts,
// tests and tools (scripts/services.sh, fuzz.sh, chaos.sh, cmd/outbox-chaos,
// the ordering, scale and plot tests), which may be set where the relay or
// its tests run.
var envExemptPrefixes = []string{
	"OUTBOX_TEST_",
	"OUTBOX_SERVICES_", "OUTBOX_FUZZ_", "OUTBOX_CHAOS_",
	"OUTBOX_DRAIN_", "OUTBOX_ORDERING_", "OUTBOX_SCALE_", "OUTBOX_PLOT_",
}

// envKeys maps environment variables to configuration keys. It knows
// OUTBOX_ plus every key path with dots as underscores, upper case
// (OUTBOX_RELAY_BATCH_SIZE), and OUTBOX_BROKERS_<NAME>_<KEY> for the keys
// of each registered broker.
type envKeys struct {
	vars    map[string]string // OUTBOX_RELAY_BATCH_SIZE -> relay.batch_size
	brokers []string          // registered names, longest first
	open    map[string]bool   // brokers whose keys are not known
}

func newEnvKeys(root *keyNode) *envKeys {
	e := &envKeys{vars: map[string]string{}, open: map[string]bool{}}
	var walk func(n *keyNode, path string)
	walk = func(n *keyNode, path string) {
		if n.children == nil {
			if !n.open { // a map's keys hold dots, which a variable name cannot
				e.vars[envName(path)] = path
			}
			return
		}
		for k, c := range n.children {
			if path == "" {
				walk(c, k)
			} else {
				walk(c, path+"."+k)
			}
		}
	}
	walk(root, "")
	for name, n := range root.children["brokers"].children {
		e.brokers = append(e.brokers, name)
		if n.open {
			e.open[name] = true
		}
	}
	sort.Slice(e.brokers, func(i, j int) bool { return len(e.brokers[i]) > len(e.brokers[j]) })
	return e
}

func envName(path string) string {
	return "OUTBOX_" + strings.ToUpper(strings.ReplaceAll(path, ".", "_"))
}

// key returns the configuration key of the variable name, "" with ok for a
// variable that is not configuration, and ok false for an OUTBOX_ variable
// that names no key.
func (e *envKeys) key(name string) (key string, ok bool) {
	if name == "DATABASE_URL" {
		return "database_url", true
	}
	if !strings.HasPrefix(name, "OUTBOX_") {
		return "", true
	}
	for _, p := range envExemptPrefixes {
		if strings.HasPrefix(name, p) {
			return "", true
		}
	}
	if k, ok := e.vars[name]; ok {
		return k, true
	}
	// A broker whose keys are not known takes any of them; its decoder
	// reports the unknown ones when it opens.
	rest, _ := strings.CutPrefix(name, "OUTBOX_BROKERS_")
	for _, b := range e.brokers {
		if k, ok := strings.CutPrefix(rest, strings.ToUpper(b)+"_"); ok && k != "" && e.open[b] {
			return "brokers." + b + "." + strings.ToLower(k), true
		}
	}
	return "", false
}

// check returns an error naming each OUTBOX_ variable in environ that is
// neither configuration nor exempt, with the closest known variable.
func (e *envKeys) check(environ []string) error {
	var names []string
	for n := range e.vars {
		names = append(names, n)
	}
	var errs []string
	for _, kv := range environ {
		name, _, _ := strings.Cut(kv, "=")
		if _, ok := e.key(name); ok {
			continue
		}
		errs = append(errs, "unknown environment variable "+name+didYouMean(closest(name, names)))
	}
	if len(errs) == 0 {
		return nil
	}
	sort.Strings(errs)
	return errors.New(strings.Join(errs, "\n"))
}

// checkFileKeys returns an error naming, with its line, each key of the
// YAML document that is not a configuration key. The file has already
// been parsed by the loader; a document that fails here is left to it.
func checkFileKeys(file string, data []byte, root *keyNode) error {
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil || len(doc.Content) == 0 {
		return nil
	}
	known := root.paths("")
	var errs []string
	var walk func(m *yaml.Node, n *keyNode, path string, depth int)
	walk = func(m *yaml.Node, n *keyNode, path string, depth int) {
		for m.Kind == yaml.AliasNode && m.Alias != nil {
			m = m.Alias
		}
		// Only mappings under a known section are checked; anything else
		// is a value, whose type the decoder checks.
		if m.Kind != yaml.MappingNode || n.children == nil || n.open || depth > 16 {
			return
		}
		for i := 0; i+1 < len(m.Content); i += 2 {
			k, v := m.Content[i], m.Content[i+1]
			if k.Tag == "!!merge" {
				// <<: *anchor merges the anchored mapping, or a list of them.
				for v.Kind == yaml.AliasNode && v.Alias != nil {
					v = v.Alias
				}
				if v.Kind == yaml.SequenceNode {
					for _, item := range v.Content {
						walk(item, n, path, depth+1)
					}
				} else {
					walk(v, n, path, depth+1)
				}
				continue
			}
			p := k.Value
			if path != "" {
				p = path + "." + k.Value
			}
			c := n.children[k.Value]
			if c == nil {
				errs = append(errs, fmt.Sprintf("config file %s:%d: unknown key %s%s", file, k.Line, p, hint(p, known, root)))
				continue
			}
			walk(v, c, p, depth+1)
		}
	}
	walk(doc.Content[0], root, "", 0)
	if len(errs) == 0 {
		return nil
	}
	return errors.New(strings.Join(errs, "\n"))
}

// hint suggests the key meant by the unknown path p. A dotted key that
// names a known path as a whole, such as relay.batch_size at the top, is
// valid only nested.
func hint(p string, known []string, root *keyNode) string {
	if parts := strings.Split(p, "."); len(parts) > 1 && root.lookup(p) != nil {
		return " (write it nested: " + strings.Join(parts, ": {") + ": ..." + strings.Repeat("}", len(parts)-1) + ")"
	}
	return didYouMean(closest(p, known))
}
