// Package dedupe turns the relay's at-least-once delivery into exactly-once
// effects on the consumer's PostgreSQL database.
//
// Each event is recorded in the processed_events table inside the same
// transaction as the handler's writes. The first delivery inserts the row,
// runs the handler and commits both together; any later delivery finds the
// row and is acknowledged without running the handler. A handler that fails
// or panics rolls the row back with its writes, so the redelivered event
// runs again.
//
// # Main types
//
// [Deduper] records processed events for one consumer. Its type parameter is
// the transaction handlers write in: [New] returns a Deduper[pgx.Tx] over a
// pgx pool, [NewSQL] a Deduper[*sql.Tx] over a database/sql handle (pgx's
// stdlib driver, lib/pq, sqlx, GORM...). Both keep the same records in the
// same table with the same guarantees.
//
//   - [Deduper.Middleware] is a Watermill middleware; the handler reaches the
//     transaction with [TxFromContext].
//   - [Deduper.Handler] and [Deduper.NoPublishHandler] wrap a [HandlerFunc] or
//     [NoPublishHandlerFunc], which receive the transaction as an argument.
//   - [Deduper.Process] gives the same guarantee outside Watermill, for an
//     event identity the caller supplies.
//   - [Deduper.Cleanup] deletes records past a retention window.
//
// A message without a usable event identity is rejected with an error
// wrapping [ErrNoEventID] by default; [Options].MissingID chooses.
//
// # Example
//
//	d, err := dedupe.New(pool, dedupe.Options{Consumer: "loyalty"})
//	if err != nil {
//		return err
//	}
//	router.AddMiddleware(d.Middleware)
//	router.AddConsumerHandler("award-points", "order", sub, func(msg *message.Message) error {
//		tx, _ := dedupe.TxFromContext[pgx.Tx](msg.Context())
//		_, err := tx.Exec(msg.Context(), `UPDATE loyalty_points SET balance = balance + 10 WHERE customer_id = $1`,
//			msg.Metadata.Get(event.HeaderAggregateID))
//		return err // an error rolls back the balance and the record together
//	})
//
// # Where next
//
// The schema must have been migrated (package store/migrate), which creates
// the processed table. docs/consumers.md walks through a consumer per broker,
// the missing-identity policy, retention and naming consumers; the brokers
// packages give each broker's SubscriberConfig.
package dedupe
