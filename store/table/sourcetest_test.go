package table_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/sourcetest"
	"github.com/outboxhq/outbox/internal/pgtest"
	"github.com/outboxhq/outbox/store/admin"
	"github.com/outboxhq/outbox/store/table"
)

// The outbox table as a source, ordered and unordered: a core.Relay over
// table.Source, as `outbox relay` runs it.
func TestSourceConformance(t *testing.T) {
	t.Run("ordered", func(t *testing.T) { sourcetest.Run(t, tableSource{}) })
	t.Run("unordered", func(t *testing.T) { sourcetest.Run(t, tableSource{unordered: true}) })
}

type tableSource struct{ unordered bool }

type tableInstance struct {
	*instance
	t         *testing.T
	unordered bool
}

func (h tableSource) Open(t *testing.T) sourcetest.Instance {
	pool, cfg := pgtest.Schema(t)
	return &tableInstance{instance: newInstance(t, pool, cfg), t: t, unordered: h.unordered}
}

// Small claims, so that the read-ahead is small next to what is written.
var tableSourceOptions = core.Options{
	BatchSize: 50, Claimers: 2, Lanes: 16, PollInterval: 50 * time.Millisecond, PublishTimeout: 10 * time.Second,
	ShutdownTimeout: 10 * time.Second,
	RetryBackoff:    core.Backoff{Min: 10 * time.Millisecond, Max: 100 * time.Millisecond},
	ErrorBackoff:    core.Backoff{Min: 10 * time.Millisecond, Max: 200 * time.Millisecond},
}

func (in *tableInstance) Write(ctx context.Context, events []core.Event) error {
	return in.Produce(ctx, events, true)
}

func (in *tableInstance) Start(t *testing.T, pub core.Publisher, obs core.Observer) sourcetest.Relay {
	t.Helper()
	proc := pgtest.NewProcess(t, 6)
	st, err := table.New(proc.Pool, in.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	o := tableSourceOptions
	o.Unordered, o.Observer = in.unordered, obs
	r, err := core.New(st, pub, o)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	return &tableRelay{t: t, r: r, proc: proc, admin: in.pool}
}

func (in *tableInstance) Retry(ctx context.Context, agg string) error {
	_, err := in.ad.Retry(ctx, admin.Selector{AggregateID: agg})
	return err
}

func (in *tableInstance) Held(ctx context.Context, agg string) ([]string, error) {
	return heldIDs(ctx, in.ad, agg)
}

// heldIDs lists an aggregate's held events through the store's inspection.
func heldIDs(ctx context.Context, st *admin.Admin, agg string) ([]string, error) {
	evs, err := st.Events(ctx, admin.EventsOptions{State: admin.StateHeld, AggregateID: agg})
	ids := make([]string, len(evs))
	for i, e := range evs {
		ids[i] = e.ID
	}
	return ids, err
}

func (in *tableInstance) ReadAhead() int {
	return tableSourceOptions.BatchSize * tableSourceOptions.Claimers
}

func (in *tableInstance) Ordered() bool { return !in.unordered }

type tableRelay struct {
	t     *testing.T
	r     *core.Relay
	proc  *pgtest.Process
	admin *pgxpool.Pool
}

func (r *tableRelay) Stop(ctx context.Context) error {
	defer r.proc.Pool.Close()
	return r.r.Stop(ctx)
}

func (r *tableRelay) Kill() {
	r.proc.Kill(r.t, r.admin)
	expired, cancel := context.WithCancel(context.Background())
	cancel()
	_ = r.r.Stop(expired)
	r.proc.Pool.Close()
}
