package logrelay_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox"
)

// Once an aggregate is handed to the table (here behind a scheduled
// event), its later events reach the table path in commit order, whatever
// order their seqs were taken in: a log-only message and a row of one
// transaction (the message's row is inserted at hand-off, after the
// row's seq was taken), and two row transactions that commit in the
// opposite order of their inserts. Without the fresh seq at hand-off the
// table path delivered 1, 3, 2 in both cases.
func TestHandedOffEventsKeepCommitOrder(t *testing.T) {
	for _, tc := range []struct {
		name  string
		write func(e *env, agg string) // commits n=2 and n=3, in commit order
	}{
		{"message and row in one transaction", func(e *env, agg string) {
			ctx := context.Background()
			err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
				if err := e.log.Write(ctx, tx, orderMsg(agg, 2)); err != nil {
					return err
				}
				return e.rows.Write(ctx, tx, orderMsg(agg, 3))
			})
			if err != nil {
				t.Fatal(err)
			}
		}},
		{"rows committed against their insert order", func(e *env, agg string) {
			ctx := context.Background()
			late, err := e.pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer late.Rollback(ctx)
			if err := e.rows.Write(ctx, late, orderMsg(agg, 3)); err != nil { // the lower seq
				t.Fatal(err)
			}
			e.writeMsgs(true, orderMsg(agg, 2)) // the higher seq, committed first
			if err := late.Commit(ctx); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			e.createSlot()
			pub := &recorder{}
			o := e.opts()
			e.startPair(pub, o)

			agg := "k2_" + uuid.NewString()[:8]
			first := orderMsg(agg, 1)
			first.DeliverAt = time.Now().Add(3 * time.Second)
			e.writeMsgs(true, first)
			tc.write(e, agg)
			waitFor(t, 20*time.Second, "three events", func() bool { return len(pub.distinct()) == 3 })
			order, _ := firstOrder(pub.events())
			if got := order[agg]; !slices.Equal(got, []int{1, 2, 3}) {
				t.Fatalf("delivered %v, want commit order [1 2 3]", got)
			}
		})
	}
}

func orderMsg(agg string, n int) outbox.Message {
	return outbox.Message{ID: uuid.Must(uuid.NewV7()).String(), AggregateID: agg, Type: "order.updated",
		Payload: []byte(`{"n":` + string(rune('0'+n)) + `}`)}
}
