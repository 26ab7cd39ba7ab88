package oracle_test

import (
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/outboxhq/outbox/internal/oracle"
	"github.com/outboxhq/outbox/internal/pgtest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// Sarama's metrics registry (the plain Kafka publisher) starts a
		// ticker goroutine per meter it never stops.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
		// A Sarama producer whose broker failed opens a circuit breaker
		// whose timer sleeps out 10s after the producer is closed.
		goleak.IgnoreAnyFunction("github.com/eapache/go-resiliency/breaker.(*Breaker).timer"),
	)
}

// Knobs of the run, from the environment:
//
//	OUTBOX_ORACLE_HISTORIES  histories per mode (default 12: the short run of `make test`)
//	OUTBOX_ORACLE_SEED       the first seed (default: from the clock, printed); with
//	                         OUTBOX_ORACLE_HISTORIES=1 it replays one history
//	OUTBOX_ORACLE_STEPS      steps per history (default 8)
//	OUTBOX_ORACLE_MODES      modes to run, comma-separated (default: every mode with
//	                         the in-process broker, and the exactly-once modes):
//	                         a mode's name alone runs it with the in-process broker,
//	                         with -kafka through the plain Kafka publisher, with -eos
//	                         through the exactly-once one (table-ordered-eos,
//	                         log-rows-eos, log-only-eos)
//	OUTBOX_ORACLE_EOS_HISTORIES  histories per exactly-once mode in the default run
//	                         (default 3: each starts a Kafka cluster of its own)
//	OUTBOX_ORACLE_WORKERS    histories run at once (default 6; a history mostly
//	                         waits, so a long run on a big machine can use more)
//	OUTBOX_ORACLE_PG_RESTARTS=1  PostgreSQL restarts among the steps (one history
//	                         at a time, on a server started by scripts/services.sh)
//	OUTBOX_ORACLE_KEEP_GOING=1  a history that breaks a promise is reported with
//	                         its seed, not shrunk, and the run goes on to its totals
//	OUTBOX_ORACLE_KNOWN=fail report the known defects as failures, and shrink them
//	                         (fail:PROMISE: only those of that promise, such as fail:replay)
const (
	defaultHistories = 12
	// defaultEOSHistories is the default run's share of each
	// exactly-once mode.
	defaultEOSHistories = 3
	defaultSteps        = 8
	// shrinkRuns bounds the reruns spent shrinking one failing history.
	shrinkRuns = 40
	// defaultWorkers is how many histories run at once, each on its own
	// outbox (schema, slots).
	defaultWorkers = 6
)

func envInt(t *testing.T, name string, def int) int {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		t.Fatalf("%s=%q: want a positive number", name, v)
	}
	return n
}

// knownDefect is a promise today's relay breaks in one mode (on one
// path). The short run skips exactly that promise in that mode;
// TestKnownDefectsStillFail runs each reproduction and fails once it no
// longer fails, so the entry is removed when the fix is merged.
type knownDefect struct {
	mode    oracle.Mode
	path    oracle.Path
	promise oracle.Promise
	what    string
	repro   oracle.History // a shrunk history that shows it
}

// knownDefects lists defects not yet fixed; an entry goes when its fix
// is merged.
var knownDefects []knownDefect

// regressions are hand-written histories that once broke a promise (the
// reproductions of known defects since fixed) or that the generator
// reaches only by chance; TestOracleRegressions runs each in every run.
var regressions = []struct {
	name string
	h    oracle.History
}{
	{"an event before a far-scheduled one of its aggregate goes out",
		history(oracle.TableOrdered, false,
			write(tx(ev(1, 1, oracle.GoRows), ev(2, 1, oracle.GoRows, oracle.Far))))},
	{"a scheduled row goes out when due, before a bad row of its aggregate handed off after it",
		history(oracle.LogRows, false,
			write(tx(ev(1, 1, oracle.GoRows, oracle.Soon))),
			write(tx(ev(2, 1, oracle.SQLInsert, oracle.Bad))))},
	{"a scheduled message goes out when due, before a bad message of its aggregate handed off after it",
		history(oracle.LogOnly, false,
			write(tx(ev(1, 1, oracle.GoLog, oracle.Soon))),
			write(tx(ev(2, 1, oracle.SQLLogWrite, oracle.Bad))))},
	{"handed-off messages and rows keep commit order",
		history(oracle.LogRows, false,
			write(tx(ev(1, 1, oracle.GoRows, oracle.Soon))),
			write(tx(ev(2, 1, oracle.GoLog), ev(3, 1, oracle.SQLInsert))))},
	{"retrying a refused message does not let the row after it go out",
		history(oracle.LogRows, false,
			write(tx(ev(1, 1, oracle.SQLLogWrite, oracle.Bad), ev(2, 1, oracle.GoRows))),
			oracle.Step{Kind: oracle.Retry, Target: 1})},
	{"a row published from the log and replayed goes out again",
		history(oracle.LogRows, false,
			write(tx(ev(1, 1, oracle.GoRows))),
			oracle.Step{Kind: oracle.Replay, Target: 1})},
	{"log-only writes before the slot are refused, with the rows of their transaction",
		history(oracle.LogRows, true,
			write(tx(ev(1, 1, oracle.GoRows), ev(2, 1, oracle.GoLog)), tx(ev(3, 2, oracle.SQLLogWrite))),
			write(tx(ev(4, 1, oracle.GoRows))))},
	{"log-only writes before the slot are refused, after it they go out",
		history(oracle.LogOnly, true,
			write(tx(ev(1, 1, oracle.GoLog)), tx(ev(2, 1, oracle.SQLLogWrite, oracle.Soon))),
			oracle.Step{Kind: oracle.StartRelay},
			write(tx(ev(3, 1, oracle.GoLog), ev(4, 1, oracle.SQLLogWrite))))},
	// The exactly-once path's.
	{"a replay after a kill goes out again, though the next take reads a progress record naming the event",
		onPath(oracle.ExactlyOnce, history(oracle.TableOrdered, false,
			write(tx(ev(1, 2, oracle.GoRows), ev(3, 1, oracle.SQLFunc))),
			oracle.Step{Kind: oracle.KillRelay},
			oracle.Step{Kind: oracle.Replay, Target: 1}))},
	{"a unit whose publishes were all in Kafka already goes on publishing",
		onPath(oracle.ExactlyOnce, history(oracle.TableOrdered, false,
			write(tx(ev(3, 1, oracle.SQLFunc))),
			oracle.Step{Kind: oracle.Replay, Target: 3},
			write(tx(ev(8, 1, oracle.SQLFunc), ev(10, 1, oracle.GoRows)))))},
	{"a row of log mode replayed through the hand-off table relay goes out again",
		onPath(oracle.ExactlyOnce, history(oracle.LogRows, false,
			write(tx(ev(1, 1, oracle.GoRows, oracle.Soon))),
			write(tx(ev(2, 1, oracle.SQLFunc))),
			oracle.Step{Kind: oracle.KillRelay},
			oracle.Step{Kind: oracle.Replay, Target: 2}))},
}

func onPath(p oracle.Path, h oracle.History) oracle.History {
	h.Path = p
	return h
}

// Builders of hand-written histories.

func history(mode oracle.Mode, stopped bool, steps ...oracle.Step) oracle.History {
	h := oracle.History{Mode: mode, StartStopped: stopped, Steps: steps}
	if stopped {
		h.Steps = append(h.Steps, oracle.Step{Kind: oracle.StartRelay})
	}
	return h
}

func write(txs ...oracle.Tx) oracle.Step { return oracle.Step{Kind: oracle.Write, Txs: txs} }

func tx(es ...oracle.EventSpec) oracle.Tx { return oracle.Tx{Events: es} }

// ev is event n of aggregate k<key>, scheduled or failing as opts say.
func ev(n, key int, p oracle.Producer, opts ...any) oracle.EventSpec {
	e := oracle.EventSpec{N: n, Key: key, Producer: p}
	for _, o := range opts {
		switch o := o.(type) {
		case oracle.Sched:
			e.Sched = o
		case oracle.Fault:
			e.Fault = o
		}
	}
	return e
}

func known(mode target, p oracle.Promise) bool {
	if v := os.Getenv("OUTBOX_ORACLE_KNOWN"); v == "fail" || v == "fail:"+string(p) {
		return false
	}
	for _, k := range knownDefects {
		if k.mode == mode.mode && k.path == mode.path && k.promise == p {
			return true
		}
	}
	return false
}

// failing returns the violations not excused by the known defects.
func failing(mode target, vs []oracle.Violation) (bad, excused []oracle.Violation) {
	for _, v := range vs {
		if known(mode, v.Promise) {
			excused = append(excused, v)
		} else {
			bad = append(bad, v)
		}
	}
	return bad, excused
}

// stats are a mode's figures over the run.
type stats struct {
	histories, deliveries, dups, stops, kills, pgRestarts, refused int
	brokerFaults, takeovers                                        int
	dupsBy                                                         map[string]int
	failed                                                         []uint64 // seeds that broke a promise (with OUTBOX_ORACLE_KEEP_GOING)
	excused                                                        map[oracle.Promise]int
}

// target is a mode and the path its relays publish by.
type target struct {
	mode oracle.Mode
	path oracle.Path
}

func (t target) String() string { return t.mode.String() + t.path.Suffix() }

// targetNamed parses a target's name: a mode's, with a path's suffix.
func targetNamed(name string) (target, bool) {
	name = strings.TrimSpace(name)
	for _, p := range []oracle.Path{oracle.InProcess, oracle.Kafka, oracle.ExactlyOnce} {
		for _, m := range oracle.Modes {
			if t := (target{m, p}); t.String() == name {
				return t, p != oracle.ExactlyOnce || m.Ordered()
			}
		}
	}
	return target{}, false
}

// Every promise in every mode: generated histories run against the real
// relays and PostgreSQL, the broker's record checked against the model.
// A failing history is shrunk and printed as steps with its seed.
func TestOracle(t *testing.T) {
	pgtest.URL(t) // skips without a server
	histories := envInt(t, "OUTBOX_ORACLE_HISTORIES", defaultHistories)
	steps := envInt(t, "OUTBOX_ORACLE_STEPS", defaultSteps)
	shape := oracle.Shape{Steps: steps, RestartPostgres: os.Getenv("OUTBOX_ORACLE_PG_RESTARTS") == "1"}
	workers := envInt(t, "OUTBOX_ORACLE_WORKERS", defaultWorkers)
	keepGoing := os.Getenv("OUTBOX_ORACLE_KEEP_GOING") == "1"
	if shape.RestartPostgres {
		if os.Getenv(envPGData) == "" {
			t.Fatalf("OUTBOX_ORACLE_PG_RESTARTS=1 needs a server of the run's own: run it under scripts/services.sh")
		}
		workers = 1 // a restart would break the other histories' writes
	}
	seed := uint64(time.Now().UnixNano() % 1_000_000)
	if v := os.Getenv("OUTBOX_ORACLE_SEED"); v != "" {
		s, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("OUTBOX_ORACLE_SEED=%q: want a number", v)
		}
		seed = s
	}
	var modes []target
	counts := map[target]int{}
	if v := os.Getenv("OUTBOX_ORACLE_MODES"); v != "" {
		for _, name := range strings.Split(v, ",") {
			m, ok := targetNamed(name)
			if !ok {
				t.Fatalf("OUTBOX_ORACLE_MODES: unknown mode %q (the exactly-once path takes the ordered modes only)", name)
			}
			modes = append(modes, m)
			counts[m] = histories
		}
	} else {
		for _, m := range oracle.Modes {
			modes = append(modes, target{m, oracle.InProcess})
			counts[target{m, oracle.InProcess}] = histories
		}
		for _, m := range oracle.Modes {
			if m.Ordered() && exactlyOnceBuilt {
				modes = append(modes, target{m, oracle.ExactlyOnce})
				counts[target{m, oracle.ExactlyOnce}] = envInt(t, "OUTBOX_ORACLE_EOS_HISTORIES", defaultEOSHistories)
			}
		}
	}
	t.Logf("seeds from %d, %d histories of %d steps per mode (OUTBOX_ORACLE_SEED=%d replays the first)", seed, histories, steps, seed)
	start := time.Now()
	totals := &totalTable{rows: map[target]*stats{}}
	// A history mostly waits (for settle points, scheduled events), so
	// several run at once, across modes, whatever go test's -parallel says.
	sem := make(chan struct{}, workers)
	var modesWG sync.WaitGroup
	for _, tg := range modes {
		mode, shape, histories := tg.mode, shape, counts[tg]
		shape.Path = tg.path
		modesWG.Go(func() {
			t.Run(tg.String(), func(t *testing.T) {
				if mode.Log() {
					pgtest.Logical(t)
				}
				if tg.path == oracle.ExactlyOnce && !exactlyOnceBuilt {
					t.Skip("the Kafka publisher has no exactly-once mode yet")
				}
				st := &stats{excused: map[oracle.Promise]int{}, dupsBy: map[string]int{}}
				results := make([]result, histories)
				var wg sync.WaitGroup
				for i := range histories {
					sem <- struct{}{}
					wg.Go(func() {
						defer func() { <-sem }()
						t.Run(fmt.Sprint(seed+uint64(i)), func(t *testing.T) {
							results[i] = run(t, oracle.Generate(mode, seed+uint64(i), shape))
						})
					})
				}
				wg.Wait()
				if t.Failed() && !keepGoing {
					return
				}
				for i, res := range results {
					st.histories++
					st.deliveries += res.deliveries
					st.dups += res.duplicates
					st.stops += res.stops
					st.kills += res.kills
					st.pgRestarts += res.pgRestarts
					st.refused += res.refused
					st.brokerFaults += res.brokerFaults
					st.takeovers += res.takeovers
					for k, n := range res.dupsBy {
						st.dupsBy[k] += n
					}
					bad, excused := failing(tg, res.violations)
					for _, v := range excused {
						st.excused[v.Promise]++
					}
					if len(bad) > 0 && keepGoing {
						st.failed = append(st.failed, seed+uint64(i))
						t.Errorf("seed %d broke %d promise(s):\n%sreplay: OUTBOX_ORACLE_SEED=%d OUTBOX_ORACLE_HISTORIES=1 OUTBOX_ORACLE_STEPS=%d OUTBOX_ORACLE_MODES=%s%s",
							seed+uint64(i), len(bad), listViolations(bad), seed+uint64(i), steps, tg, restartsFlag(shape))
						continue
					}
					if len(bad) > 0 {
						h := oracle.Generate(mode, seed+uint64(i), shape)
						small, vs := shrink(t, h, bad[0].Promise)
						t.Errorf("seed %d broke %d promise(s), first %s\nshrunk history:\n%s\nits violations:\n%s\nreplay: OUTBOX_ORACLE_SEED=%d OUTBOX_ORACLE_HISTORIES=1 OUTBOX_ORACLE_STEPS=%d OUTBOX_ORACLE_MODES=%s%s",
							h.Seed, len(bad), bad[0], small, listViolations(vs), h.Seed, steps, tg, restartsFlag(shape))
						return
					}
				}
				t.Logf("%s: %d histories, %d deliveries, %d duplicates over %d relay kills, %d graceful stops, %d PostgreSQL restarts, %d broker faults, %d log-only writes refused before the slot; known defects seen: %v",
					tg, st.histories, st.deliveries, st.dups, st.kills, st.stops, st.pgRestarts, st.brokerFaults, st.refused, st.excused)
				totals.add(tg, st)
			})
		})
	}
	modesWG.Wait()
	t.Logf("%d modes in %s", len(modes), time.Since(start).Round(100*time.Millisecond))
	totals.print(t, modes, time.Since(start))
}

func restartsFlag(s oracle.Shape) string {
	if s.RestartPostgres {
		return " OUTBOX_ORACLE_PG_RESTARTS=1"
	}
	return ""
}

func listViolations(vs []oracle.Violation) string {
	var b strings.Builder
	for _, v := range vs {
		b.WriteString("  " + v.String() + "\n")
	}
	return b.String()
}

// shrink reruns smaller versions of h while they still break promise p:
// without one step, then without one event, then with one transaction
// fewer in a concurrent step. It returns the smallest found and its
// violations.
func shrink(t *testing.T, h oracle.History, p oracle.Promise) (oracle.History, []oracle.Violation) {
	t.Helper()
	var last []oracle.Violation
	runs := 0
	fails := func(c oracle.History) bool {
		if runs >= shrinkRuns {
			return false
		}
		runs++
		var res result
		t.Run(fmt.Sprintf("shrink-%d", runs), func(t *testing.T) { res = run(t, c) })
		for _, v := range res.violations {
			if v.Promise == p {
				last = res.violations
				return true
			}
		}
		return false
	}
	for changed := true; changed && runs < shrinkRuns; {
		changed = false
		for _, c := range candidates(h) {
			if fails(c) {
				h, changed = c, true
				break
			}
		}
	}
	if last == nil {
		t.Logf("shrinking found no smaller failing history in %d runs", runs)
	}
	return h, last
}

// candidates are the histories one simplification smaller than h.
func candidates(h oracle.History) []oracle.History {
	var out []oracle.History
	with := func(steps []oracle.Step) {
		c := h
		c.Steps = steps
		c = c.Normalize()
		if len(c.Steps) < len(h.Steps) || events(c) < events(h) || txs(c) < txs(h) {
			out = append(out, c)
		}
	}
	for i := len(h.Steps) - 1; i >= 0; i-- {
		with(append(append([]oracle.Step(nil), h.Steps[:i]...), h.Steps[i+1:]...))
	}
	if h.StartStopped {
		c := h
		c.StartStopped = false
		out = append(out, c)
	}
	for i, s := range h.Steps {
		for j, tx := range s.Txs {
			if len(s.Txs) > 1 {
				steps := clone(h.Steps)
				steps[i].Txs = append(append([]oracle.Tx(nil), s.Txs[:j]...), s.Txs[j+1:]...)
				with(steps)
			}
			for k := range tx.Events {
				steps := clone(h.Steps)
				ev := append(append([]oracle.EventSpec(nil), tx.Events[:k]...), tx.Events[k+1:]...)
				steps[i].Txs[j].Events = ev
				with(steps)
			}
		}
	}
	return out
}

func clone(steps []oracle.Step) []oracle.Step {
	out := make([]oracle.Step, len(steps))
	for i, s := range steps {
		s.Txs = append([]oracle.Tx(nil), s.Txs...)
		out[i] = s
	}
	return out
}

func events(h oracle.History) int { return len(h.Events()) }

func txs(h oracle.History) int {
	n := 0
	for _, s := range h.Steps {
		n += len(s.Txs)
	}
	return n
}

// Each known defect's reproduction still breaks its promise: once one no
// longer does, its fix is merged and its entry must go, so that the
// promise is checked again in every run.
func TestKnownDefectsStillFail(t *testing.T) {
	pgtest.URL(t) // skips without a server
	var wg sync.WaitGroup
	defer wg.Wait()
	for _, k := range knownDefects {
		wg.Go(func() {
			tg := target{k.mode, k.path}
			t.Run(tg.String()+"/"+string(k.promise), func(t *testing.T) {
				if k.mode.Log() {
					pgtest.Logical(t)
				}
				if k.repro.Mode != k.mode || k.repro.Path != k.path {
					t.Fatalf("the reproduction runs in mode %s%s, the entry names %s", k.repro.Mode, k.repro.Path.Suffix(), tg)
				}
				var res result
				t.Run("run", func(t *testing.T) { res = run(t, k.repro) })
				for _, v := range res.violations {
					if v.Promise == k.promise {
						t.Logf("still broken (%s): %s", k.what, v)
						return
					}
				}
				t.Errorf("the known defect %q no longer shows in mode %s: remove its entry from knownDefects (its promise is then checked again); violations: %v\n%s",
					k.what, tg, res.violations, k.repro)
			})
		})
	}
}

// The regressions hold every promise.
func TestOracleRegressions(t *testing.T) {
	pgtest.URL(t) // skips without a server
	var wg sync.WaitGroup
	defer wg.Wait()
	for _, r := range regressions {
		wg.Go(func() {
			t.Run(r.h.Mode.String()+r.h.Path.Suffix()+"/"+r.name, func(t *testing.T) {
				if r.h.Mode.Log() {
					pgtest.Logical(t)
				}
				var res result
				t.Run("run", func(t *testing.T) { res = run(t, r.h) })
				if len(res.violations) > 0 {
					t.Errorf("%s\nviolations:\n%s", r.h, listViolations(res.violations))
				}
			})
		})
	}
}

// totalTable gathers each mode's figures, printed together at the end of a
// run, the plain and exactly-once paths side by side.
type totalTable struct {
	mu   sync.Mutex
	rows map[target]*stats
}

func (tb *totalTable) add(tg target, st *stats) {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	tb.rows[tg] = st
}

func (tb *totalTable) print(t *testing.T, modes []target, took time.Duration) {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	var b strings.Builder
	fmt.Fprintf(&b, "totals (%s):\n%-24s %9s %10s %10s %6s %9s %6s %9s %13s%s\n", took.Round(time.Second),
		"mode", "histories", "deliveries", "duplicates", "kills", "takeovers", "stops", "restarts", "broker-faults", "  duplicates after (the last fault step before each)")
	var all stats
	for _, tg := range modes {
		st := tb.rows[tg]
		if st == nil {
			continue
		}
		fmt.Fprintf(&b, "%-24s %9d %10d %10d %6d %9d %6d %9d %13d  %s\n", tg, st.histories, st.deliveries, st.dups, st.kills, st.takeovers, st.stops, st.pgRestarts, st.brokerFaults, byFault(st.dupsBy))
		if len(st.failed) > 0 {
			fmt.Fprintf(&b, "%-24s failing seeds: %v\n", "", st.failed)
		}
		all.histories += st.histories
		all.deliveries += st.deliveries
		all.dups += st.dups
		all.kills += st.kills
		all.stops += st.stops
		all.pgRestarts += st.pgRestarts
		all.brokerFaults += st.brokerFaults
		all.takeovers += st.takeovers
	}
	fmt.Fprintf(&b, "%-24s %9d %10d %10d %6d %9d %6d %9d %13d", "all", all.histories, all.deliveries, all.dups, all.kills, all.takeovers, all.stops, all.pgRestarts, all.brokerFaults)
	t.Log(b.String())
}

func byFault(m map[string]int) string {
	var parts []string
	for k, n := range m {
		parts = append(parts, fmt.Sprintf("%s %d", k, n))
	}
	sort.Strings(parts)
	return strings.Join(parts, ", ")
}
