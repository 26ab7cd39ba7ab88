package outboxcli

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/cobra"

	"github.com/outboxhq/outbox/cmd/outbox/console"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/metrics"
	"github.com/outboxhq/outbox/store/admin"
	"github.com/outboxhq/outbox/store/table"
)

// docFiles are README.md and docs/*.md, by name.
func docFiles(t *testing.T) map[string]string {
	t.Helper()
	names, err := filepath.Glob("../../../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	names = append(names, "../../../README.md")
	out := map[string]string{}
	for _, n := range names {
		b, err := os.ReadFile(n)
		if err != nil {
			t.Fatal(err)
		}
		out[strings.TrimPrefix(n, "../../../")] = string(b)
	}
	return out
}

// docCode returns what the docs set as code: each inline span and each
// line of a fenced block.
func docCode(doc string) []string {
	var out []string
	fenced := false
	for _, line := range strings.Split(doc, "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			fenced = !fenced
			continue
		}
		if fenced {
			out = append(out, line)
			continue
		}
		for _, m := range inlineCode.FindAllStringSubmatch(line, -1) {
			out = append(out, m[1])
		}
	}
	return out
}

var inlineCode = regexp.MustCompile("`([^`]+)`")

// The docs name only commands, flags, configuration keys, environment
// variables, metrics and endpoints the binary has: each `outbox ...`
// command line is parsed against the command tree, each OUTBOX_ variable
// and dotted key against the configuration, each outbox_ metric against
// what the relay registers, each path against the relay's handler.
func TestDocsNameTheBinarysSurface(t *testing.T) {
	root := NewRoot(io.Discard, io.Discard)
	env := newEnvKeys(configKeys())
	keys := map[string]bool{}
	for _, p := range configKeys().paths("") {
		keys[p] = true
	}
	metricNames := registeredMetrics(t)
	mux := relayMux(t)

	cmdLine := regexp.MustCompile(`(?:^|[\s(])outbox ([a-z][a-z-]*(?: [a-z][a-z-]*)?)((?: +[^\s|;&#>]+)*)`)
	envVar := regexp.MustCompile(`\bOUTBOX_[A-Z0-9_]+\b`)
	dotted := regexp.MustCompile(`^(relay|store|http|console|retention|stuck|database|producer|log|tracing|routing|cloudevents)\.[a-z_.]+$`)
	metric := regexp.MustCompile(`\boutbox_[a-z_]+_(?:total|seconds|bytes|events|size|active|timestamp_seconds|relay)\b`)
	path := regexp.MustCompile(`(?:^|\s|\()((?:/api/v1|/console)/[a-z0-9/{}._-]*|/metrics|/healthz|/readyz)`)

	testVar := regexp.MustCompile(`^OUTBOX_(TEST|ORACLE|CHAOS|SERVICES)_`)

	var problems []string
	bad := func(file, format string, a ...any) {
		problems = append(problems, file+": "+fmt.Sprintf(format, a...))
	}
	for file, doc := range docFiles(t) {
		for _, code := range docCode(doc) {
			if strings.Contains(code, "did you mean") || strings.HasPrefix(strings.TrimSpace(code), "//") {
				continue // an error message about a wrong name, a Go comment
			}
			for _, m := range cmdLine.FindAllStringSubmatch(code, -1) {
				checkDocCommand(root, file, m[1], m[2], bad)
			}
			for _, v := range envVar.FindAllString(code, -1) {
				if strings.HasSuffix(v, "_") || strings.Contains(code, v+"...") || strings.Contains(code, v+"<") {
					continue // a prefix, as in OUTBOX_BROKERS_<NAME>_<KEY>
				}
				if testVar.MatchString(v) {
					continue // read by the tests and their harness, not by the binary
				}
				if _, ok := env.key(v); !ok {
					bad(file, "%s is not a configuration variable", v)
				}
			}
			if c := strings.TrimSpace(code); dotted.MatchString(c) && !strings.HasSuffix(c, ".") {
				if !keys[c] && !keys[strings.TrimSuffix(c, ".*")] {
					bad(file, "%s is not a configuration key", c)
				}
			}
			for _, name := range metric.FindAllString(code, -1) {
				if !metricNames[strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(name, "_bucket"), "_sum"), "_count")] {
					bad(file, "metric %s is not registered by the relay", name)
				}
			}
			for _, m := range path.FindAllStringSubmatch(code, -1) {
				p := strings.NewReplacer("{seq}", "1", "{ref}", "1", "{id}", "1", "{action}", "retry", "{retry", "retry").Replace(m[1])
				p = strings.TrimSuffix(p, ".")
				if p == "/api/v1/" || p == "/console/static/" {
					continue // a prefix
				}
				if !serves(mux, p) {
					bad(file, "the relay serves no %s", m[1])
				}
			}
		}
	}
	sort.Strings(problems)
	for _, p := range problems {
		t.Error(p)
	}
}

// checkDocCommand checks `outbox <words> <args>` against the command tree.
func checkDocCommand(root *cobra.Command, file, words, args string, bad func(file, format string, a ...any)) {
	f := strings.Fields(words)
	cmd, _, err := root.Find(f)
	if err != nil || cmd == root {
		// Prose such as "outbox relay" in a sentence is a command too; a
		// word after it that is no subcommand is prose.
		if cmd, _, err = root.Find(f[:1]); err != nil || cmd == root {
			bad(file, "`outbox %s` is no command", f[0])
			return
		}
	}
	for _, a := range strings.Fields(args) {
		a = strings.Trim(a, "[]()`,.")
		if !strings.HasPrefix(a, "--") {
			continue
		}
		name, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		name = strings.TrimRight(name, "]")
		if name == "" || strings.Contains(name, "...") {
			continue
		}
		if cmd.Flags().Lookup(name) == nil && cmd.InheritedFlags().Lookup(name) == nil && name != "help" {
			bad(file, "`outbox %s` has no flag --%s", cmd.CommandPath()[len("outbox "):], name)
		}
	}
}

// registeredMetrics is every metric the relay's /metrics can show: the
// relay's observer, the backlog poller and the slot gauges, read from the
// descriptions of what they register (a vector without children yet is
// not gathered).
func registeredMetrics(t *testing.T) map[string]bool {
	t.Helper()
	reg := &recordingRegisterer{Registerer: prometheus.NewRegistry()}
	if _, err := metrics.NewObserver(metrics.Options{Registerer: reg, Broker: "b"}); err != nil {
		t.Fatal(err)
	}
	if _, err := metrics.NewPoller(&table.Source{}, metrics.PollerOptions{Registerer: reg}); err != nil {
		t.Fatal(err)
	}
	newSlotMetrics(reg)
	descs := make(chan *prometheus.Desc)
	go func() {
		defer close(descs)
		for _, c := range reg.cs {
			c.Describe(descs)
		}
	}()
	fq := regexp.MustCompile(`fqName: "([^"]+)"`)
	names := map[string]bool{}
	for d := range descs {
		if m := fq.FindStringSubmatch(d.String()); m != nil {
			names[m[1]] = true
		}
	}
	if len(names) < 10 {
		t.Fatalf("only %d metrics found: %v", len(names), names)
	}
	return names
}

// recordingRegisterer keeps what is registered through it.
type recordingRegisterer struct {
	prometheus.Registerer
	cs []prometheus.Collector
}

func (r *recordingRegisterer) Register(c prometheus.Collector) error {
	r.cs = append(r.cs, c)
	return r.Registerer.Register(c)
}

func (r *recordingRegisterer) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}

// serves reports whether h has a route for GET p: an answer other than 404,
// or a panic of a route's handler over the empty store the test gives it.
func serves(h http.Handler, p string) (ok bool) {
	defer func() {
		if recover() != nil {
			ok = true
		}
	}()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, p, nil))
	return rec.Code != http.StatusNotFound
}

// relayMux is the relay's HTTP handler with the console mounted.
func relayMux(t *testing.T) *http.ServeMux {
	t.Helper()
	mux := opsHandler(prometheus.NewRegistry(), func(context.Context) []core.Check { return nil }, discardLogger())
	con, err := console.New(console.Options{Admin: &admin.Admin{}, AnonymousReads: true})
	if err != nil {
		t.Fatal(err)
	}
	mountConsole(mux, con)
	return mux
}
