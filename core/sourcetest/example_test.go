package sourcetest_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/sourcetest"
	"github.com/outboxhq/outbox/internal/memsource"
)

// A source passes the suite from its own test. This harness runs a
// core.Relay over the in-memory source; a kill makes every claim of the
// killed relay end unrecorded, as a dead database session does.
func ExampleRun() {
	_ = func(t *testing.T) { sourcetest.Run(t, memSource{}) }
}

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestMemsource(t *testing.T) { sourcetest.Run(t, memSource{}) }

type memSource struct{}

func (memSource) Open(t *testing.T) sourcetest.Instance {
	return &memInstance{st: memsource.New(), aggs: map[int64]string{}, ids: map[int64]string{}}
}

var memOptions = core.Options{
	BatchSize: 50, Claimers: 2, Lanes: 16, PollInterval: 20 * time.Millisecond,
	PublishTimeout: 10 * time.Second, ShutdownTimeout: 10 * time.Second,
	RetryBackoff: core.Backoff{Min: 10 * time.Millisecond, Max: 100 * time.Millisecond},
	ErrorBackoff: core.Backoff{Min: 10 * time.Millisecond, Max: 100 * time.Millisecond},
}

type memInstance struct {
	st   *memsource.Source
	mu   sync.Mutex
	aggs map[int64]string // aggregate of each seq
	ids  map[int64]string // event id of each seq
}

func (in *memInstance) Write(_ context.Context, events []core.Event) error {
	seqs := in.st.Add(events...)
	in.mu.Lock()
	defer in.mu.Unlock()
	for i, seq := range seqs {
		in.aggs[seq], in.ids[seq] = events[i].AggregateID, events[i].ID
	}
	return nil
}

func (in *memInstance) Start(t *testing.T, pub core.Publisher, obs core.Observer) sourcetest.Relay {
	k := &killable{Source: in.st}
	o := memOptions
	o.Observer = obs
	r, err := core.New(k, pub, o)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	return &memRelay{r: r, k: k}
}

func (in *memInstance) Retry(_ context.Context, agg string) error {
	in.mu.Lock()
	defer in.mu.Unlock()
	for _, seq := range in.st.Pending() {
		if in.aggs[seq] == agg {
			in.st.Retry(seq)
		}
	}
	return nil
}

func (in *memInstance) Held(_ context.Context, agg string) ([]string, error) {
	in.mu.Lock()
	defer in.mu.Unlock()
	var ids []string
	for _, seq := range in.st.Pending() {
		if in.aggs[seq] == agg && in.st.Held(seq) {
			ids = append(ids, in.ids[seq])
		}
	}
	return ids, nil
}

func (in *memInstance) ReadAhead() int { return memOptions.BatchSize * memOptions.Claimers }
func (in *memInstance) Ordered() bool  { return true }

// killable is the source as one relay process sees it: once killed, its
// claims end without recording, as a dead session's transactions do.
type killable struct {
	*memsource.Source
	dead atomic.Bool
}

var errKilled = errors.New("killed")

func (k *killable) Claim(ctx context.Context, o core.ClaimOptions) (core.Claim, error) {
	if k.dead.Load() {
		return nil, errKilled
	}
	c, err := k.Source.Claim(ctx, o)
	if err != nil {
		return nil, err
	}
	return &killableClaim{Claim: c, k: k}, nil
}

type killableClaim struct {
	core.Claim
	k *killable
}

func (c *killableClaim) Complete(ctx context.Context, done []int64, failed []core.Failure) error {
	if c.k.dead.Load() {
		_ = c.Release(ctx)
		return errKilled
	}
	return c.Claim.Complete(ctx, done, failed)
}

type memRelay struct {
	r *core.Relay
	k *killable
}

func (r *memRelay) Stop(ctx context.Context) error { return r.r.Stop(ctx) }

func (r *memRelay) Kill() {
	r.k.dead.Store(true)
	expired, cancel := context.WithCancel(context.Background())
	cancel()
	_ = r.r.Stop(expired)
}
