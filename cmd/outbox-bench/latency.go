package main

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/core"
	tablesrc "github.com/outboxhq/outbox/store/table"
)

// stamps pairs each event's commit time with its publish time, by event id.
type stamps struct {
	mu        sync.Mutex
	committed map[string]time.Time
	published map[string]time.Time
}

var _ core.Publisher = (*stamps)(nil)

func newStamps() *stamps {
	return &stamps{committed: map[string]time.Time{}, published: map[string]time.Time{}}
}

func (s *stamps) commit(uid string, t time.Time) {
	s.mu.Lock()
	s.committed[uid] = t
	s.mu.Unlock()
}

func (s *stamps) Publish(_ context.Context, e *core.Event) error {
	s.arrive(e.ID, time.Now())
	return nil
}

// arrive records the first time an event arrived.
func (s *stamps) arrive(uid string, t time.Time) {
	s.mu.Lock()
	if _, dup := s.published[uid]; !dup {
		s.published[uid] = t
	}
	s.mu.Unlock()
}

// reset forgets everything recorded so far.
func (s *stamps) reset() {
	s.mu.Lock()
	clear(s.committed)
	clear(s.published)
	s.mu.Unlock()
}

func (s *stamps) Close() error { return nil }

func (s *stamps) counts() (committed, published int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for uid := range s.committed {
		if _, ok := s.published[uid]; ok {
			published++
		}
	}
	return int64(len(s.committed)), published
}

// latencies returns publish minus commit for every committed event that
// was published, and how many were not. The relay can publish an event a
// moment before the producer's Commit call returns (the commit is durable
// before the client hears of it); such events count as zero.
func (s *stamps) latencies() ([]time.Duration, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]time.Duration, 0, len(s.committed))
	missing := 0
	for uid, c := range s.committed {
		p, ok := s.published[uid]
		if !ok {
			missing++
			continue
		}
		out = append(out, max(0, p.Sub(c)))
	}
	return out, missing
}

// timedStore is the PostgreSQL store, timing each claim: when it started
// and ended, by event id, so a latency can be split into its parts. Being
// the store itself, embedded, it keeps the store's optional capabilities.
type timedStore struct {
	*tablesrc.Source
	mu     sync.Mutex
	claims map[string][2]time.Time

	// Set, a claim that runs past slowClaim is watched from another
	// session: what pg_stat_activity says the relay's sessions are doing,
	// sampled every few milliseconds until the claim returns.
	watch *pgxpool.Pool
	app   string         // the relay sessions' application_name
	waits map[string]int // samples by state, statement and wait event
}

// slowClaim is how long a claim runs before it is watched.
const slowClaim = 5 * time.Millisecond

func (t *timedStore) Claim(ctx context.Context, req core.ClaimOptions) (core.Claim, error) {
	start := time.Now()
	var watched chan struct{}
	if t.watch != nil {
		done := make(chan struct{})
		watched = make(chan struct{})
		defer func() { close(done); <-watched }()
		go func() { defer close(watched); t.sample(ctx, done) }()
	}
	c, err := t.Source.Claim(ctx, req)
	if err != nil {
		return c, err
	}
	end := time.Now()
	t.mu.Lock()
	for _, e := range c.Events() {
		t.claims[e.ID] = [2]time.Time{start, end}
	}
	t.mu.Unlock()
	return c, nil
}

// sample records, every 2ms from slowClaim on until done closes, each
// busy relay session's state, the start of its statement and its wait
// event (none: on a CPU). A sample that finds every relay session idle
// counts as "not in a statement": the time is the client's (the round
// trips, the relay process waiting for a CPU).
func (t *timedStore) sample(ctx context.Context, done <-chan struct{}) {
	tick := time.NewTimer(slowClaim)
	defer tick.Stop()
	for {
		select {
		case <-done:
			return
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		rows, err := t.watch.Query(ctx, `SELECT state || ' ' || btrim(regexp_replace(left(query, 40), '\s+', ' ', 'g')) || coalesce(' ' || wait_event_type || ':' || wait_event, '')
FROM pg_stat_activity WHERE application_name = $1 AND state <> 'idle'`, t.app)
		if err != nil {
			return
		}
		waits, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return
		}
		if len(waits) == 0 {
			waits = []string{"not in a statement"}
		}
		t.mu.Lock()
		for _, w := range waits {
			t.waits[w]++
		}
		t.mu.Unlock()
		tick.Reset(2 * time.Millisecond)
	}
}

// waitSummary lists the sampled waits, most frequent first.
func (t *timedStore) waitSummary() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.waits) == 0 {
		return ""
	}
	keys := make([]string, 0, len(t.waits))
	for k := range t.waits {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b string) int { return cmp.Or(cmp.Compare(t.waits[b], t.waits[a]), cmp.Compare(a, b)) })
	var parts []string
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s %d", k, t.waits[k]))
	}
	return fmt.Sprintf("; claims over %s, sampled every 2ms: %s", slowClaim, strings.Join(parts, ", "))
}

// tail splits the latencies of the events at or above the p-th percentile
// into their parts, and says which part made them slow: the wait from
// COMMIT's return to the start of the claim that took the event (poll or
// wake-up), the claim's SQL, and the time from the claim's end to the
// publish (queued behind other events of the batch, the lane, the
// publisher).
func (t *timedStore) tail(s *stamps, p float64) string {
	t.mu.Lock()
	defer t.mu.Unlock()
	s.mu.Lock()
	defer s.mu.Unlock()
	type parts struct{ total, wait, claim, lane time.Duration }
	var all []parts
	for uid, c := range s.committed {
		pub, ok := s.published[uid]
		cl, ok2 := t.claims[uid]
		if !ok || !ok2 {
			continue
		}
		all = append(all, parts{max(0, pub.Sub(c)), max(0, cl[0].Sub(c)), cl[1].Sub(cl[0]), max(0, pub.Sub(cl[1]))})
	}
	if len(all) == 0 {
		return ""
	}
	slices.SortFunc(all, func(a, b parts) int { return cmp.Compare(a.total, b.total) })
	slow := all[int(float64(len(all)-1)*p/100):]
	var w, c, l []time.Duration
	for _, x := range slow {
		w, c, l = append(w, x.wait), append(c, x.claim), append(l, x.lane)
	}
	return fmt.Sprintf("the %d events at or above p%g: median wait for a claim %s, claim %s, claim end to publish %s",
		len(slow), p, fmtDur(percentile(w, 50)), fmtDur(percentile(c, 50)), fmtDur(percentile(l, 50)))
}

// warmPool opens n connections of p and puts them back.
func warmPool(ctx context.Context, p *pgxpool.Pool, n int) error {
	conns := make([]*pgxpool.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			c.Release()
		}
	}()
	for range n {
		c, err := p.Acquire(ctx)
		if err != nil {
			return fmt.Errorf("warm pool: %w", err)
		}
		conns = append(conns, c)
	}
	return nil
}

// beginner is what a producer writes through: a pool, or one session of it.
type beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// produceStamped writes event i in a transaction of its own and stamps its commit.
func (b *bench) produceStamped(ctx context.Context, db beginner, w *outbox.Writer, rec *stamps, i int64) (time.Time, error) {
	id, err := uuid.NewV7()
	if err != nil {
		return time.Time{}, fmt.Errorf("new event id: %w", err)
	}
	uid := id.String()
	if err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		return w.Write(ctx, tx, outbox.Message{ID: uid, AggregateID: aggregateID(i, b.cfg.Aggregates),
			Type: "bench.event", Payload: []byte(`{"n":1}`)})
	}); err != nil {
		return time.Time{}, fmt.Errorf("produce: %w", err)
	}
	t := time.Now()
	rec.commit(uid, t)
	return t, nil
}

// warmUp writes one event on each of n sessions of p, held at once so
// that each is a different one, and waits until all of them are
// published; then it forgets them. A session's first write compiles the
// table's PL/pgSQL functions (tens of milliseconds), and the producers'
// catching up after it bunches their commits: a start-up cost, not the
// relay's latency.
func (b *bench) warmUp(ctx context.Context, p *pgxpool.Pool, n int, w *outbox.Writer, rec *stamps) error {
	conns := make([]*pgxpool.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			c.Release()
		}
	}()
	for i := range n {
		c, err := p.Acquire(ctx)
		if err != nil {
			return fmt.Errorf("warm up: %w", err)
		}
		conns = append(conns, c)
		if _, err := b.produceStamped(ctx, c, w, rec, int64(i)); err != nil {
			return fmt.Errorf("warm up: %w", err)
		}
	}
	if got := waitCount(ctx, func() int64 { _, p := rec.counts(); return p }, int64(n), 30*time.Second); got < int64(n) {
		return fmt.Errorf("warm up: %d of %d events published within 30s", got, n)
	}
	rec.reset()
	return nil
}

// poolWaits says how often the relay waited for a connection of its pool
// since since (pgxpool counts acquires that found none idle, and their
// total time).
func poolWaits(p *pgxpool.Pool, since *pgxpool.Stat) string {
	s := p.Stat()
	return fmt.Sprintf("; relay pool: %d of %d acquires waited for a connection, %s acquiring in all",
		s.EmptyAcquireCount()-since.EmptyAcquireCount(), s.AcquireCount()-since.AcquireCount(),
		fmtDur(s.AcquireDuration()-since.AcquireDuration()))
}

// openLoop offers work at rate per second for d, on up to workers
// goroutines; it returns when every offered call has finished.
func openLoop(ctx context.Context, rate, workers int, d time.Duration, work func(ctx context.Context, i int64) error) error {
	jobs := make(chan int64, rate*int(d/time.Second+1))
	errs := make(chan error, workers)
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range jobs {
				if err := work(ctx, i); err != nil {
					select {
					case errs <- err:
					default:
					}
					return
				}
			}
		}()
	}
	interval := time.Second / time.Duration(rate)
	start := time.Now()
	tick := time.NewTicker(time.Millisecond)
	var sent int64
	total := int64(d / interval)
loop:
	for sent < total {
		select {
		case <-ctx.Done():
			break loop
		case err := <-errs:
			close(jobs)
			wg.Wait()
			return err
		case now := <-tick.C:
			due := min(total, int64(now.Sub(start)/interval)+1)
			for ; sent < due; sent++ {
				jobs <- sent
			}
		}
	}
	tick.Stop()
	close(jobs)
	wg.Wait()
	select {
	case err := <-errs:
		return err
	default:
		return ctx.Err()
	}
}

func (b *bench) latencyRun(ctx context.Context, rate int, wakeups bool) (latencyRow, error) {
	cfg, drop, err := b.schema(ctx, "latency")
	if err != nil {
		return latencyRow{}, err
	}
	defer drop()
	relayPool, err := openPool(ctx, b.namedURL(benchLatencyApp), 4, nil)
	if err != nil {
		return latencyRow{}, err
	}
	defer relayPool.Close()
	// Warm, as the binary keeps its pool: a claim that connects first is
	// a start-up cost, not the relay's latency.
	if err := warmPool(ctx, relayPool, 4); err != nil {
		return latencyRow{}, err
	}
	warm := relayPool.Stat()
	pst, err := tablesrc.New(relayPool, cfg, b.log)
	if err != nil {
		return latencyRow{}, fmt.Errorf("new store: %w", err)
	}
	st := &timedStore{Source: pst, claims: map[string][2]time.Time{}, watch: b.pool, app: benchLatencyApp, waits: map[string]int{}}
	rec := newStamps()
	opts := b.relayOptions(false, nil)
	opts.DisableWakeups = !wakeups
	relay, err := core.New(st, rec, opts)
	if err != nil {
		return latencyRow{}, fmt.Errorf("new relay: %w", err)
	}
	if err := relay.Start(ctx); err != nil {
		return latencyRow{}, fmt.Errorf("start relay: %w", err)
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		_ = relay.Stop(sctx)
	}()
	time.Sleep(200 * time.Millisecond) // the listener connects

	pool, err := b.producerPool(ctx)
	if err != nil {
		return latencyRow{}, err
	}
	defer pool.Close()
	w, err := outbox.NewWriter(outbox.WriterOptions{Store: cfg})
	if err != nil {
		return latencyRow{}, err
	}
	if err := b.warmUp(ctx, pool, 16, w, rec); err != nil { // its sessions are watched from the start
		return latencyRow{}, err
	}
	sched := watchSched(ctx, b.pool, benchLatencyApp)
	start := time.Now()
	var last time.Time
	var lastMu sync.Mutex
	err = openLoop(ctx, rate, 16, b.cfg.LatencyRun, func(ctx context.Context, i int64) error {
		t, err := b.produceStamped(ctx, pool, w, rec, i)
		if err != nil {
			return err
		}
		lastMu.Lock()
		if t.After(last) {
			last = t
		}
		lastMu.Unlock()
		return nil
	})
	if err != nil {
		return latencyRow{}, err
	}
	committed := func() int64 { c, p := rec.counts(); return p - c } // reaches 0 when all are out
	waitCount(ctx, committed, 0, 3*time.Second+opts.PollInterval)
	schedNote := sched.summary()
	lat, missing := rec.latencies()
	row := latencyRow{Rate: rate, Wakeups: wakeups, Path: "in process", Events: len(lat), Missing: missing,
		P50: percentile(lat, 50), P99: percentile(lat, 99), P999: percentile(lat, 99.9), Max: percentile(lat, 100),
		Note: st.tail(rec, 99) + poolWaits(relayPool, warm) + st.waitSummary() + schedNote}
	if el := last.Sub(start); el > 0 {
		row.Achieved = float64(len(lat)+missing) / el.Seconds()
	}
	b.log.Info("latency", "rate", rate, "wakeups", wakeups, "achieved", int(row.Achieved), "p50", row.P50, "p99", row.P99, "max", row.Max, "missing", missing)
	return row, nil
}

func (b *bench) latencySection(ctx context.Context, rep *report) error {
	brokers, skipped := b.e2eBrokers()
	defer func() {
		for _, br := range brokers {
			br.close()
		}
	}()
	rep.Latency = append(rep.Latency, skipped...)
	// Each broker with the table relay and the log relay, side by side.
	for _, br := range brokers {
		if b.latencyPath(br.name + ", broker alone") {
			b.settle(ctx)
			row, err := b.e2eAlone(ctx, br, 1000)
			if err != nil {
				if ctx.Err() != nil {
					return err
				}
				b.log.Warn("broker alone not measured", "path", row.Path, "error", err)
				row.Note = "not measured: " + err.Error()
			}
			rep.Latency = append(rep.Latency, row)
		}
		for _, run := range []struct {
			rate    int
			logMode bool
		}{{1000, false}, {1000, true}, {5000, false}, {5000, true}} {
			name := br.name
			if run.logMode {
				name += ", log mode"
			}
			if !b.latencyPath(name) {
				continue
			}
			b.settle(ctx)
			row, err := b.e2eRun(ctx, br, run.rate, run.logMode)
			if err != nil {
				if ctx.Err() != nil {
					return err
				}
				b.log.Warn("end-to-end latency not measured", "path", row.Path, "rate", run.rate, "error", err)
				row = latencyRow{Rate: run.rate, Wakeups: true, Path: row.Path, Note: "not measured: " + err.Error()}
			}
			rep.Latency = append(rep.Latency, row)
		}
	}
	for _, wakeups := range []bool{true, false} {
		for _, rate := range []int{100, 1000, 5000} {
			if !b.latencyPath("in process") {
				continue
			}
			b.settle(ctx)
			row, err := b.latencyRun(ctx, rate, wakeups)
			if err != nil {
				return fmt.Errorf("latency at %d/s: %w", rate, err)
			}
			rep.Latency = append(rep.Latency, row)
		}
	}
	return nil
}

// latencyPath says whether the run's -latency-paths lets the path run: a
// path runs when every word of one of the list's entries is in its name.
func (b *bench) latencyPath(name string) bool { return selected(b.cfg.LatencyPaths, name) }

// selected says whether a filter of entries separated by commas lets name
// run: every word of one entry is in it. An empty filter lets all run.
func selected(filter, name string) bool {
	if filter == "" {
		return true
	}
	name = strings.ToLower(name)
	for _, entry := range strings.Split(strings.ToLower(filter), ",") {
		words := strings.Fields(entry)
		if len(words) > 0 && !slices.ContainsFunc(words, func(w string) bool { return !strings.Contains(name, w) }) {
			return true
		}
	}
	return false
}
