package logrelay_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/sourcetest"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store/admin"
	"github.com/outboxhq/outbox/store/logrelay"
)

// The replication log as a source, with rows and with log-only messages:
// a logrelay.Pair, as `outbox relay --mode log` runs it.
func TestSourceConformance(t *testing.T) {
	for _, fl := range flavours {
		t.Run(fl.name, func(t *testing.T) { sourcetest.Run(t, logSource{rows: fl.table}) })
	}
}

type logSource struct{ rows bool }

type logInstance struct {
	e    *env
	rows bool
	st   *admin.Admin
}

func (h logSource) Open(t *testing.T) sourcetest.Instance {
	e := newEnv(t)
	e.createSlot() // before any write: a log-only write needs a slot
	st, err := admin.New(e.pool, e.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	return &logInstance{e: e, rows: h.rows, st: st}
}

// logReadAhead is the log relay's MaxInFlight in the suite.
const logReadAhead = 100

func (in *logInstance) Write(ctx context.Context, events []core.Event) error {
	msgs := make([]outbox.Message, len(events))
	for i, ev := range events {
		msgs[i] = outbox.Message{ID: ev.ID, AggregateID: ev.AggregateID, Type: ev.Type, Payload: ev.Payload}
	}
	return pgx.BeginFunc(ctx, in.e.pool, func(tx pgx.Tx) error {
		if in.rows {
			return in.e.rows.Write(ctx, tx, msgs...)
		}
		return in.e.log.Write(ctx, tx, msgs...)
	})
}

func (in *logInstance) Start(t *testing.T, pub core.Publisher, obs core.Observer) sourcetest.Relay {
	t.Helper()
	proc := pgtest.NewProcess(t, 6)
	o := in.e.opts()
	o.ApplicationName, o.Observer = proc.Name, obs
	o.MaxInFlight, o.PublishTimeout = logReadAhead, 10*time.Second
	p, err := logrelay.NewPair(proc.Pool, pub, o, handOff(t, proc.Pool, o, nil), core.Options{
		PollInterval: 50 * time.Millisecond, PublishTimeout: 10 * time.Second, Observer: obs,
		RetryBackoff: o.RetryBackoff, ErrorBackoff: o.ErrorBackoff,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &pairRelay{t: t, proc: proc, admin: in.e.pool, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- p.Run(ctx) }()
	// Started means reading: a relay that is killed before it holds the
	// slot tests nothing.
	waitFor(t, 20*time.Second, "the relay to hold the slot", p.Log.Holding)
	return r
}

func (in *logInstance) Retry(ctx context.Context, agg string) error {
	_, err := in.st.Retry(ctx, admin.Selector{AggregateID: agg})
	return err
}

func (in *logInstance) Held(ctx context.Context, agg string) ([]string, error) {
	evs, err := in.st.Events(ctx, admin.EventsOptions{State: admin.StateHeld, AggregateID: agg})
	ids := make([]string, len(evs))
	for i, e := range evs {
		ids[i] = e.ID
	}
	return ids, err
}

func (in *logInstance) ReadAhead() int { return logReadAhead }
func (in *logInstance) Ordered() bool  { return true }

type pairRelay struct {
	t      *testing.T
	proc   *pgtest.Process
	admin  *pgxpool.Pool
	cancel context.CancelFunc
	done   chan error
}

func (r *pairRelay) Stop(ctx context.Context) error {
	defer r.proc.Pool.Close()
	r.cancel()
	select {
	case err := <-r.done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Kill ends the relay's sessions first, so neither the log relay's drain
// nor the table path can record anything, then stops it.
func (r *pairRelay) Kill() {
	r.proc.Kill(r.t, r.admin)
	r.cancel()
	<-r.done // the killed connections' error
	r.proc.Pool.Close()
}
