package admin_test

import (
	"context"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/outboxhq/outbox/store"
	"github.com/outboxhq/outbox/store/admin"
)

// An operator's view of what does not go out, and the two ways to unblock
// an aggregate held by a permanent failure.
func ExampleAdmin_Stuck() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://localhost/app")
	if err != nil {
		return
	}
	defer pool.Close()
	st, err := admin.New(pool, store.Config{}, nil)
	if err != nil {
		return
	}
	stuck, err := st.Stuck(ctx, admin.StuckOptions{OlderThan: 5 * time.Minute})
	if err != nil {
		return
	}
	for _, e := range stuck {
		switch {
		case e.Held && strings.Contains(e.LastError, "no topic route"):
			// After adding the routing rule:
			_, _ = st.Retry(ctx, admin.Selector{Seqs: []int64{e.Seq}})
		case e.Held:
			_, _ = st.Park(ctx, admin.Selector{Seqs: []int64{e.Seq}}, "rejected by the broker: "+e.LastError)
		}
	}
}
