package table

import (
	"context"

	"github.com/outboxhq/outbox/store"
)

// CloseSleeper closes the connection Sleep opened, as the end of Listen
// does, for tests that sleep without listening.
func (s *Source) CloseSleeper(ctx context.Context) { s.closeSleeper(ctx) }

// ShareKeys are the advisory lock classes of cfg's sharing members and
// partitions.
func ShareKeys(cfg store.Config) (member, part int32) {
	cfg, _ = cfg.WithDefaults()
	return (&Source{cfg: cfg}).shareKeys()
}
