package core_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/memsource"
)

// truncatingStore reports every claim as cut short by other relays, as the
// PostgreSQL store does when its gate holds events back.
type truncatingStore struct {
	core.Source
	claims atomic.Int64
}

type truncatedClaim struct{ core.Claim }

func (truncatedClaim) Truncated() bool { return true }

func (s *truncatingStore) Claim(ctx context.Context, req core.ClaimOptions) (core.Claim, error) {
	s.claims.Add(1)
	c, err := s.Source.Claim(ctx, req)
	if err != nil {
		return nil, err
	}
	return truncatedClaim{c}, nil
}

// A claim cut short means work is waiting behind other relays: the relay
// comes back within tens of milliseconds, not after its poll interval, yet
// does not spin.
func TestTruncatedClaimComesBackSoon(t *testing.T) {
	st := &truncatingStore{Source: memsource.New()}
	startRelay(t, st, pubFunc(func(context.Context, *core.Event) error { return nil }),
		core.Options{PollInterval: time.Hour, DisableWakeups: true})
	time.Sleep(500 * time.Millisecond)
	n := st.claims.Load()
	if n < 5 {
		t.Errorf("%d claims in 500ms with truncated claims and an hour's poll interval; want the short pause", n)
	}
	if n > 100 {
		t.Errorf("%d claims in 500ms: the relay spins on truncated claims", n)
	}
}
