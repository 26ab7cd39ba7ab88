package oracle_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/oracle"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/admin"
	"github.com/outboxhq/outbox/store/logrelay"
)

// maxEventBytes is the relays' event size limit in these runs: a Bad
// event is written by SQL with a payload over it, which the relay holds.
const maxEventBytes = 2048

// The server scripts/services.sh started: its binaries and data directory,
// for PostgreSQL restarts.
const (
	envPGBin  = "OUTBOX_TEST_PG_BIN"
	envPGData = "OUTBOX_TEST_PG_DATA"
)

// Bounds of one history's run. Everything owed is normally delivered
// within a few hundred milliseconds (backoffs are 10-100 ms, a Soon event
// is due 1.2 s after its write; four histories run at once); settleTimeout is the bound past which an
// owed delivery counts as missing, generous for a loaded 2-core machine.
// settleQuiet is how long the broker is watched after that for deliveries
// the model forbids.
const (
	settleTimeout = 5 * time.Second
	settleQuiet   = 250 * time.Millisecond
)

// result is one history's run.
type result struct {
	violations               []oracle.Violation
	deliveries               int
	duplicates               int            // deliveries beyond one per event not owed to a replay
	dupsBy                   map[string]int // duplicates by the last fault step before them
	stops, kills, pgRestarts int
	brokerFaults             int // Kafka cluster faults injected
	takeovers                int
	refused                  int // transactions whose log-only write was refused
}

// run runs h against the real relay of its mode on a fresh outbox.
func run(t *testing.T, h oracle.History) result {
	t.Helper()
	pool, cfg := pgtest.Schema(t)
	cfg.MaxEventBytes = maxEventBytes
	cfg, err := cfg.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	d := &driver{t: t, h: h, pool: pool, cfg: cfg, pub: newBroker(), ids: map[string]int{}, replayed: map[string]int{}}
	d.commits = newCommitLog(t, pool, cfg)
	if d.rows, err = outbox.NewWriter(outbox.WriterOptions{Store: cfg}); err != nil {
		t.Fatal(err)
	}
	if d.log, err = outbox.NewLogWriter(outbox.WriterOptions{Store: cfg}); err != nil {
		t.Fatal(err)
	}
	if d.ops, err = admin.New(pool, cfg, nil); err != nil {
		t.Fatal(err)
	}
	if h.Mode.Log() {
		// Unnamed: the relay resolves the default name itself, as a
		// library user's relay does (the outbox command resolves it
		// before; both end with the same name).
		if d.slot, err = (logrelay.Slot{}).WithDefaults(cfg); err != nil {
			t.Fatal(err)
		}
		// Registered after the schema's cleanup, so it runs first: a slot
		// left behind would hold the shared server's WAL.
		t.Cleanup(d.dropSlot)
	}
	d.sim = oracle.NewSim(h.Mode)
	if h.Path == oracle.ExactlyOnce {
		d.sim.ExactlyOnce()
	}
	if h.Path.Kafka() {
		d.kafka = newKafkaSide(t, h.Path, d.pub)
	}
	d.rng = rand.New(rand.NewPCG(h.Seed, 7))
	if !h.StartStopped {
		d.start()
	}
	for _, s := range h.Steps {
		if s.Operator() {
			d.settle()
		}
		d.step(s)
	}
	if d.relay == nil {
		d.start()
	}
	if d.kafka != nil {
		// What a killed relay left open is fenced by now, or never
		// will be: its producers go, still without ending their
		// transactions.
		d.kafka.closeAbandoned()
	}
	d.settle()
	d.stop()
	if d.kafka != nil {
		d.kafka.stop()
	}
	for n, id := range d.idsByN() {
		if d.handedOff(id) {
			d.sim.HandedOff(n)
		}
	}
	rec := d.pub.record(d.ids)
	res := result{violations: d.sim.Check(rec), deliveries: len(rec), stops: d.stops, kills: d.kills, pgRestarts: d.pgRestarts, refused: d.refused, brokerFaults: d.brokerFaults, takeovers: d.takeovers}
	seen := map[string]int{}
	res.dupsBy = map[string]int{}
	for _, r := range rec {
		seen[r.ID]++
		if seen[r.ID] > 1+d.replayed[r.ID] {
			res.duplicates++
			res.dupsBy[d.faultBefore(r.Counter)]++
		}
	}
	return res
}

// faultMark is a fault step and the delivery counter when it ran.
type faultMark struct {
	kind string
	mark int
}

// faultBefore names the last fault step run before delivery counter c:
// the one a duplicate delivered then is put down to.
func (d *driver) faultBefore(c int) string {
	what := "no fault"
	for _, f := range d.faults {
		if f.mark < c {
			what = f.kind
		}
	}
	return what
}

type driver struct {
	t       *testing.T
	h       oracle.History
	pool    *pgxpool.Pool
	cfg     store.Config
	slot    logrelay.Slot
	pub     *broker
	kafka   *kafkaSide // on a Kafka path: the cluster and the consumer whose reads feed pub's record
	rows    *outbox.Writer
	log     *outbox.LogWriter
	ops     *admin.Admin
	commits *commitLog
	sim     *oracle.Sim
	rng     *rand.Rand

	ids          map[string]int // event id -> label
	relay        *relay
	slotMade     bool
	generation   int // relay processes started
	stops        int
	kills        int
	pgRestarts   int
	brokerFaults int
	takeovers    int
	faults       []faultMark
	replayed     map[string]int // replays per event id
	txs          int            // producer transactions run
	refused      int            // of them refused by the log write function
}

func (d *driver) idsByN() map[int]string {
	out := map[int]string{}
	for id, n := range d.ids {
		out[n] = id
	}
	return out
}

func (d *driver) step(s oracle.Step) {
	d.t.Helper()
	switch s.Kind {
	case oracle.StopRelay, oracle.KillRelay, oracle.RestartPostgres, oracle.FailProduce, oracle.FailCommit, oracle.Takeover:
		kind := map[oracle.StepKind]string{oracle.StopRelay: "stop", oracle.KillRelay: "kill", oracle.RestartPostgres: "pg-restart",
			oracle.FailProduce: "produce-fault", oracle.FailCommit: "commit-fault", oracle.Takeover: "takeover"}[s.Kind]
		if s.Kind == oracle.FailProduce && s.Target == 3 {
			kind = "produce-timeout"
		}
		d.faults = append(d.faults, faultMark{kind, d.pub.counter()})
	}
	switch s.Kind {
	case oracle.Write:
		d.write(s.Txs)
	case oracle.StartRelay:
		if d.relay == nil {
			d.start()
		}
	case oracle.StopRelay:
		d.stop()
		d.stops++
	case oracle.RestartPostgres:
		d.restartPostgres()
	case oracle.KillRelay:
		if d.relay != nil {
			d.relay.kill(d.t, d.pool)
			if d.kafka != nil {
				d.kafka.abandon(d.relay.pub)
			}
			d.relay = nil
			d.kills++
		}
		d.start()
	case oracle.Takeover:
		if d.relay == nil {
			d.start()
		}
		d.takeover()
		d.takeovers++
	case oracle.FailProduce, oracle.FailCommit:
		if d.kafka != nil {
			d.kafka.fail(s)
			d.brokerFaults++
		}
	default:
		d.operate(s)
	}
}

// settle waits until every delivery the model owes has arrived and every
// event it says the relay holds is recorded held (or settleTimeout
// passed), watches a moment longer, and seals the point. In log mode the
// log relay records a failed event held when it hands it to the table,
// which after a kill can come seconds after the write; an operator's
// retry before then would find nothing to retry.
func (d *driver) settle() {
	owed := d.sim.Settle(d.relay != nil)
	ids := d.idsByN()
	var held []string
	for _, n := range d.sim.Held() {
		held = append(held, ids[n])
	}
	deadline := time.Now().Add(settleTimeout)
	for time.Now().Before(deadline) {
		if d.pub.has(owed, ids) && d.allHeld(held) && (d.relay == nil || d.allMarked(d.pub.delivered())) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(settleQuiet)
	d.sim.Seal(d.pub.counter())
}

// allMarked says whether every row among the events ids is recorded
// dispatched. A relay marks a row after the broker took it; an operator's
// replay right after a delivery but before its mark finds the row not yet
// dispatched and replays nothing, so the system has not settled before.
func (d *driver) allMarked(ids []string) bool {
	var n int
	err := d.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+pgx.Identifier{d.cfg.Schema, d.cfg.Table}.Sanitize()+
		" WHERE event_id = ANY($1::uuid[]) AND dispatched_at IS NULL", ids).Scan(&n)
	if err != nil {
		d.t.Fatalf("marked events: %v", err)
	}
	return n == 0
}

// allHeld says whether the events ids are recorded held: failed, not to
// be retried until an operator says so.
func (d *driver) allHeld(ids []string) bool {
	if len(ids) == 0 {
		return true
	}
	var n int
	err := d.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+pgx.Identifier{d.cfg.Schema, d.cfg.Table}.Sanitize()+
		" WHERE event_id = ANY($1::uuid[]) AND dispatched_at IS NULL AND retry_at = 'infinity'", ids).Scan(&n)
	if err != nil {
		d.t.Fatalf("held events: %v", err)
	}
	return n == len(ids)
}

func (d *driver) operate(s oracle.Step) {
	d.t.Helper()
	ctx := context.Background()
	id := d.idsByN()[s.Target]
	mark := d.pub.counter()
	if s.Kind == oracle.Retry {
		d.pub.forgive(id) // the operator fixed what made it fail
	}
	var seq int64
	err := d.pool.QueryRow(ctx, "SELECT seq FROM "+pgx.Identifier{d.cfg.Schema, d.cfg.Table}.Sanitize()+" WHERE event_id = $1", id).Scan(&seq)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		d.t.Fatalf("%s: find the row: %v", s, err)
	}
	d.sim.Operate(s, mark, err == nil)
	if err != nil {
		return // a log-only event not in the table: no row to act on
	}
	sel := admin.Selector{Seqs: []int64{seq}}
	var n int64
	switch s.Kind {
	case oracle.Retry:
		_, err = d.ops.Retry(ctx, sel)
	case oracle.Park:
		_, err = d.ops.Park(ctx, sel, "oracle")
	case oracle.Unpark:
		_, err = d.ops.Unpark(ctx, sel)
	case oracle.Replay:
		n, err = d.ops.Replay(ctx, sel, admin.ReplayOptions{})
		d.replayed[id] += int(n)
		for range n {
			d.sim.Replayed(s.Target)
		}
	}
	if err != nil {
		d.t.Fatalf("%s: %v", s, err)
	}
	if d.relay != nil {
		d.relay.wake()
	}
}

// write runs the transactions concurrently and tells the model what the
// database says of each event: committed or not, commit position, seq.
func (d *driver) write(txs []oracle.Tx) {
	d.t.Helper()
	type planned struct {
		spec oracle.EventSpec
		id   string
		at   time.Time
	}
	plans := make([][]planned, len(txs))
	sleeps := make([][]time.Duration, len(txs))
	for i, tx := range txs {
		for _, e := range tx.Events {
			p := planned{spec: e, id: uuid.Must(uuid.NewV7()).String()}
			switch e.Sched {
			case oracle.Soon:
				p.at = time.Now().Add(oracle.SoonDelay)
			case oracle.Far:
				p.at = time.Now().Add(oracle.FarDelay)
			}
			d.ids[p.id] = e.N
			switch e.Fault {
			case oracle.Transient:
				d.pub.failTransiently(p.id, 1+d.rng.IntN(2))
			case oracle.Permanent:
				d.pub.failPermanently(p.id)
			}
			plans[i] = append(plans[i], p)
			sleeps[i] = append(sleeps[i], time.Duration(d.rng.IntN(4000))*time.Microsecond)
		}
	}
	slot := d.slotMade
	var wg sync.WaitGroup
	errs := make(chan error, len(txs))
	refused := make([]bool, len(txs))
	for i, tx := range txs {
		wg.Go(func() {
			ctx := context.Background()
			err := pgx.BeginFunc(ctx, d.pool, func(ptx pgx.Tx) error {
				if tx.Lock {
					keys := map[int]bool{}
					for _, e := range tx.Events {
						keys[e.Key] = true
					}
					var ks []int
					for k := range keys {
						ks = append(ks, k)
					}
					sort.Ints(ks)
					for _, k := range ks {
						if _, err := ptx.Exec(ctx, "SELECT pg_advisory_xact_lock(hashtext($1))", d.cfg.Schema+"/"+key(k)); err != nil {
							return fmt.Errorf("lock: %w", err)
						}
					}
				}
				for j, p := range plans[i] {
					if err := d.produce(ctx, ptx, p.spec, p.id, p.at); err != nil {
						if !p.spec.Producer.Row() && isRefusal(err) {
							refused[i] = true // the model says whether it should have been
							return errRollback
						}
						return fmt.Errorf("%s: %w", p.spec, err)
					}
					if len(txs) > 1 {
						time.Sleep(sleeps[i][j])
					}
				}
				if tx.Rollback {
					return errRollback
				}
				return nil
			})
			if err != nil && !errors.Is(err, errRollback) {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		d.t.Fatalf("write: %v", err)
	}
	pos := d.commits.read(d.t)
	for i, tx := range txs {
		d.txs++
		if refused[i] {
			d.refused++
		}
		for _, p := range plans[i] {
			w := oracle.Written{ID: p.id, CommitPos: -1, DeliverAt: p.at, Tx: d.txs, BeforeSlot: d.h.Mode.Log() && !slot, Refused: refused[i]}
			if c, ok := pos[p.id]; ok {
				w.Committed, w.CommitPos = true, c
			}
			if want := !tx.Rollback && !refused[i]; w.Committed != want {
				d.t.Fatalf("%s: committed %v, but the transaction was to %s", p.spec, w.Committed, map[bool]string{true: "commit", false: "roll back"}[want])
			}
			if w.Committed && p.spec.Producer.Row() {
				if err := d.pool.QueryRow(context.Background(), "SELECT seq FROM "+pgx.Identifier{d.cfg.Schema, d.cfg.Table}.Sanitize()+" WHERE event_id = $1", p.id).Scan(&w.Seq); err != nil {
					d.t.Fatalf("%s: seq: %v", p.spec, err)
				}
			}
			d.sim.Wrote(p.spec, w)
		}
	}
}

var errRollback = errors.New("rollback")

// isRefusal says whether err is the log write function refusing a write
// while no slot reads it.
func isRefusal(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "55000"
}

func key(k int) string { return fmt.Sprintf("k%d", k) }

type body struct {
	N   int    `json:"n"`
	Pad string `json:"pad,omitempty"`
}

// produce writes one event the way its producer does.
func (d *driver) produce(ctx context.Context, tx pgx.Tx, e oracle.EventSpec, id string, at time.Time) error {
	b := body{N: e.N}
	if e.Fault == oracle.Bad {
		b.Pad = strings.Repeat("x", maxEventBytes)
	}
	payload, _ := json.Marshal(b)
	m := outbox.Message{ID: id, AggregateID: key(e.Key), Type: "oracle.event", Payload: json.RawMessage(payload), DeliverAt: at}
	var deliverAt *time.Time
	if !at.IsZero() {
		deliverAt = &at
	}
	table := pgx.Identifier{d.cfg.Schema, d.cfg.Table}.Sanitize()
	switch e.Producer {
	case oracle.GoRows:
		return d.rows.Write(ctx, tx, m)
	case oracle.GoLog:
		return d.log.Write(ctx, tx, m)
	case oracle.SQLFunc:
		_, err := tx.Exec(ctx, "SELECT "+pgx.Identifier{d.cfg.Schema, d.cfg.Table + "_write"}.Sanitize()+
			"($1, $2, $3::text, deliver_at => $4, event_id => $5)", m.AggregateID, m.Type, string(payload), deliverAt, id)
		return err
	case oracle.SQLInsert:
		_, err := tx.Exec(ctx, "INSERT INTO "+table+" (event_id, aggregate_id, type, payload, deliver_at) VALUES ($1, $2, $3, $4::json, $5)",
			id, m.AggregateID, m.Type, string(payload), deliverAt)
		return err
	case oracle.SQLLogWrite:
		fn, err := d.cfg.LogWriteFunc()
		if err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `SELECT `+fn+`(json_build_object(
    'v', 1, 'event_id', $1::uuid, 'aggregate_id', $2::text, 'type', $3::text,
    'deliver_at', $4::timestamptz, 'payload', $5::json)::text)`, id, m.AggregateID, m.Type, deliverAt, string(payload))
		return err
	}
	return fmt.Errorf("unknown producer %d", e.Producer)
}

func (d *driver) handedOff(id string) bool {
	var h bool
	err := d.pool.QueryRow(context.Background(), "SELECT handoff_at IS NOT NULL FROM "+pgx.Identifier{d.cfg.Schema, d.cfg.Table}.Sanitize()+" WHERE event_id = $1", id).Scan(&h)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		d.t.Fatalf("handoff of %s: %v", id, err)
	}
	return h
}

func (d *driver) dropSlot() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for {
		err := logrelay.DropSlot(ctx, d.pool, d.cfg, d.slot)
		if err == nil || errors.Is(err, logrelay.ErrNoSlot) {
			return
		}
		if !errors.Is(err, logrelay.ErrSlotBusy) || ctx.Err() != nil {
			d.t.Logf("drop slot %s: %v", d.slot.Name, err)
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// commitLog reads the database's commit order from a logical decoding
// slot of its own, with PostgreSQL's test_decoding plugin: the outbox's
// row inserts and its log-only messages, transaction by transaction in
// commit order, independent of the relay's own decoding.
type commitLog struct {
	pool   *pgxpool.Pool
	name   string
	table  string // "schema.table: INSERT:" prefix of the outbox's inserts
	prefix string // the outbox's message prefix
	next   int
	seen   map[string]int
}

var (
	rowID = regexp.MustCompile(`event_id\[uuid\]:'([^']+)'`)
	msgID = regexp.MustCompile(`"event_id"\s*:\s*"([^"]+)"`)
)

func newCommitLog(t *testing.T, pool *pgxpool.Pool, cfg store.Config) *commitLog {
	t.Helper()
	prefix, err := logrelay.MessagePrefix(cfg)
	if err != nil {
		t.Fatal(err)
	}
	c := &commitLog{pool: pool, name: "oracle_" + cfg.Schema, table: "table " + cfg.Schema + "." + cfg.Table + ": INSERT:",
		prefix: "prefix: " + prefix + ",", seen: map[string]int{}}
	if _, err := pool.Exec(context.Background(), "SELECT pg_create_logical_replication_slot($1, 'test_decoding')", c.name); err != nil {
		t.Fatalf("create the oracle's slot: %v", err)
	}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "SELECT pg_drop_replication_slot($1)", c.name) })
	return c
}

// read consumes the slot and returns every event id seen so far with its
// commit position (its first appearance: a log-only event handed to the
// table appears again as a row).
func (c *commitLog) read(t *testing.T) map[string]int {
	t.Helper()
	rows, err := c.pool.Query(context.Background(), "SELECT data FROM pg_logical_slot_get_changes($1, NULL, NULL)", c.name)
	if err != nil {
		t.Fatalf("read the oracle's slot: %v", err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatalf("read the oracle's slot: %v", err)
	}
	for _, l := range lines {
		var m []string
		switch {
		case strings.HasPrefix(l, c.table):
			m = rowID.FindStringSubmatch(l)
		case strings.HasPrefix(l, "message: transactional: 1 ") && strings.Contains(l, c.prefix):
			m = msgID.FindStringSubmatch(l)
		}
		if m == nil {
			continue
		}
		if _, ok := c.seen[m[1]]; !ok {
			c.seen[m[1]] = c.next
			c.next++
		}
	}
	return c.seen
}

// broker is the in-process broker: it records every publish, numbered,
// and fails the events it is told to.
type broker struct {
	mu        sync.Mutex
	got       []oracle.Delivery
	transient map[string]int
	permanent map[string]bool
}

func newBroker() *broker {
	return &broker{transient: map[string]int{}, permanent: map[string]bool{}}
}

func (b *broker) failTransiently(id string, times int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.transient[id] = times
}

func (b *broker) failPermanently(id string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.permanent[id] = true
}

func (b *broker) forgive(id string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.permanent, id)
}

func (b *broker) Publish(ctx context.Context, e *core.Event) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.admitLocked(e.ID); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	b.addLocked(e.ID, time.Now(), "")
	return nil
}

// admit fails the event as told: the faults of one event, which a Kafka
// path injects before its publisher.
func (b *broker) admit(id string) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.admitLocked(id)
}

func (b *broker) admitLocked(id string) error {
	if b.permanent[id] {
		return core.Permanent(errors.New("the broker refuses this event"))
	}
	if b.transient[id] > 0 {
		b.transient[id]--
		return errors.New("the broker is unavailable")
	}
	return nil
}

// add records a delivery: on a Kafka path, a record the consumer read.
func (b *broker) add(id string, at time.Time, via string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.addLocked(id, at, via)
}

func (b *broker) addLocked(id string, at time.Time, via string) {
	b.got = append(b.got, oracle.Delivery{ID: id, Counter: len(b.got) + 1, At: at, Via: via})
}

func (b *broker) Close() error { return nil }

// delivered returns the ids of the events delivered at least once.
func (b *broker) delivered() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	seen := map[string]bool{}
	var out []string
	for _, d := range b.got {
		if !seen[d.ID] {
			seen[d.ID] = true
			out = append(out, d.ID)
		}
	}
	return out
}

func (b *broker) counter() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.got)
}

// has says whether every owed label has a delivery after its counter.
func (b *broker) has(owed map[int]int, ids map[int]string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	for n, after := range owed {
		found := false
		for _, d := range b.got[min(after, len(b.got)):] {
			if d.ID == ids[n] {
				found = true
				break
			}
		}
		if !found {
			return false
		}
	}
	return true
}

// record returns the deliveries with their labels.
func (b *broker) record(ids map[string]int) []oracle.Delivery {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make([]oracle.Delivery, len(b.got))
	for i, d := range b.got {
		n, ok := ids[d.ID]
		if !ok {
			n = -1
		}
		d.N = n
		out[i] = d
	}
	return out
}

// restartPostgres crashes the server (immediate shutdown: sessions end,
// open transactions are lost, recovery runs at the start) and starts it
// again, then waits for it. A fast shutdown would wait for the log
// relay's walsender until the relay confirmed everything sent, which it
// does not while an event it read is still unpublished.
func (d *driver) restartPostgres() {
	d.t.Helper()
	bin, data := os.Getenv(envPGBin), os.Getenv(envPGData)
	args := []string{"-D", data, "restart", "-m", "immediate", "-w", "-t", "120", "-l", filepath.Join(filepath.Dir(data), "pgsock", "pg.log")}
	name := filepath.Join(bin, "pg_ctl")
	cmd := exec.Command(name, args...)
	if os.Geteuid() == 0 { // PostgreSQL refuses to run as root
		cmd = exec.Command("runuser", append([]string{"-u", "postgres", "--", name}, args...)...)
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		d.t.Fatalf("restart PostgreSQL: %v: %s", err, out)
	}
	d.pgRestarts++
	d.pool.Reset()
	deadline := time.Now().Add(60 * time.Second)
	for d.pool.Ping(context.Background()) != nil {
		if time.Now().After(deadline) {
			d.t.Fatal("PostgreSQL did not answer within 60s of its restart")
		}
		time.Sleep(100 * time.Millisecond)
	}
}
