package logrelay

import (
	"context"

	"github.com/outboxhq/outbox/store"
)

// LogTable gives the external tests the log table's record of a slot and
// its position.
type LogTable struct{ t *logTable }

func NewLogTable(cfg store.Config) (LogTable, error) {
	t, err := newLogTable(cfg)
	return LogTable{t}, err
}

func (l LogTable) RecordSlot(ctx context.Context, db store.DBTX, slot, publication string) error {
	return l.t.recordSlot(ctx, db, slot, publication)
}

func (l LogTable) RecordPosition(ctx context.Context, db store.DBTX, slot, lsn string) error {
	return l.t.recordPosition(ctx, db, slot, lsn)
}

func (l LogTable) Position(ctx context.Context, db querier, slot string) (string, error) {
	return l.t.position(ctx, db, slot)
}
