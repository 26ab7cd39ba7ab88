package admin

import (
	"log/slog"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxhq/outbox/store"
)

// Admin runs the operator queries on one outbox. It is safe for
// concurrent use.
type Admin struct {
	pool *pgxpool.Pool
	cfg  store.Config
	n    store.Names
	log  *slog.Logger
}

// New returns an Admin of the outbox cfg names, over pool. log may be nil.
func New(pool *pgxpool.Pool, cfg store.Config, log *slog.Logger) (*Admin, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Admin{pool: pool, cfg: cfg, n: cfg.Names(), log: log}, nil
}

// Config returns the outbox's configuration with defaults filled in.
func (s *Admin) Config() store.Config { return s.cfg }
