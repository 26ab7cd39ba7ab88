package core_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/memsource"
)

// partStore is a store whose relay claims from part of the ordered work,
// as a PostgreSQL store that shares its partitions with other relays. It
// keeps the most claims it saw open at once.
type partStore struct {
	*gatedStore
	part    float64
	shared  chan struct{} // closed once the part was given
	maxOpen atomic.Int64
}

func (s *partStore) Share(ctx context.Context, changed func(part float64)) error {
	changed(s.part)
	close(s.shared)
	<-ctx.Done()
	return nil
}

func (s *partStore) Claim(ctx context.Context, req core.ClaimOptions) (core.Claim, error) {
	c, err := s.gatedStore.Claim(ctx, req)
	if n := s.open.Load(); n > s.maxOpen.Load() {
		s.maxOpen.Store(n)
	}
	return c, err
}

func newPartStore(part float64) (*partStore, *memsource.Source) {
	ms := memsource.New()
	return &partStore{gatedStore: &gatedStore{Source: ms}, part: part, shared: make(chan struct{})}, ms
}

// A relay with a quarter of the work opens a quarter of its claims: one
// at a time while its batches are quick. With the whole work it overlaps
// them, so the check can tell the two apart.
func TestRelayOpensItsPartOfTheClaims(t *testing.T) {
	for _, tc := range []struct {
		part     float64
		overlaps bool
	}{{0.25, false}, {1, true}} {
		t.Run(fmt.Sprint(tc.part), func(t *testing.T) {
			st, ms := newPartStore(tc.part)
			pub := pubFunc(func(ctx context.Context, e *core.Event) error {
				time.Sleep(time.Millisecond)
				return nil
			})
			r := startRelay(t, st, pub, core.Options{BatchSize: 5, Lanes: 4, Claimers: 4, PollInterval: time.Millisecond})
			<-st.shared
			for i := range 200 {
				ms.Add(core.Event{AggregateID: fmt.Sprintf("agg-%d", i)})
			}
			r.Wake()
			waitFor(t, "every event to be published", drained(ms))
			if got := st.maxOpen.Load(); (got > 1) != tc.overlaps {
				t.Fatalf("at most %d claims were open at once with part %v of the work and 4 claimers", got, tc.part)
			}
		})
	}
}

// A relay that opens fewer claims than Claimers still opens the rest while
// a batch stays open on a slow publish: the other aggregates keep flowing.
func TestSlowPublishOpensTheOtherClaims(t *testing.T) {
	st, ms := newPartStore(0.25)
	slow := make(chan struct{})
	var published log
	pub := holding(&published, slow, func(e *core.Event) bool { return e.AggregateID == "slow" })
	startRelay(t, st, pub, core.Options{BatchSize: 5, Lanes: 4, Claimers: 4, PollInterval: time.Millisecond})
	<-st.shared
	ms.Add(core.Event{AggregateID: "slow"})
	for i := range 40 {
		ms.Add(core.Event{AggregateID: fmt.Sprintf("agg-%d", i)})
	}
	waitFor(t, "the other aggregates' events to be published while one publish hangs", func() bool {
		return len(published.seqs()) == 40
	})
	close(slow)
	waitFor(t, "every event to be published", drained(ms))
}
