package migrate

import (
	"context"
	"errors"
	"fmt"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/outboxhq/outbox/store"
)

// Roles names the database roles that get the least privileges their job
// needs on one outbox. The roles must exist; the tables belong to the role
// that ran the migrations, so none of these can drop or alter them. An
// empty name grants nothing for that job.
type Roles struct {
	// Relay claims, marks and, for retention, deletes events: SELECT,
	// UPDATE and DELETE on the outbox and SELECT on its migrations table
	// (the schema check at start-up), and EXECUTE on the row check's
	// function. Operator commands (stuck, retry, park, replay, cleanup)
	// work under it too.
	Relay string
	// LogMode grants the relay what relay.mode log needs besides: SELECT
	// and UPDATE on the handoff view (migration 8), and INSERT on the
	// outbox with USAGE on its seq sequence, to hand log-only events to the
	// table. A relay in table mode never inserts, so it is not granted to.
	LogMode bool
	// Producer only inserts events: INSERT on the outbox, USAGE on its seq
	// sequence and EXECUTE on the event_id default's function, the row
	// check's function and the write function (migration 7). It cannot
	// read payloads back.
	Producer string
	// Consumer records processed events for deduplication: SELECT, INSERT,
	// UPDATE and DELETE on the processed table. UPDATE is there for the row
	// locks of the cleanup (FOR UPDATE SKIP LOCKED requires it); no
	// statement changes a row.
	Consumer string
	// NoRetention leaves out what only retention needs: the relay's DELETE
	// on the outbox and its rights on the processed table. Without it the
	// relay can also clean old processed rows, as its retention does.
	NoRetention bool
}

// Grants returns the GRANT statements for r on the outbox named by cfg,
// with every identifier quoted.
func Grants(cfg store.Config, r Roles) ([]string, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return nil, err
	}
	if r.Relay == "" && r.Producer == "" && r.Consumer == "" {
		return nil, errors.New("grants: name at least one role")
	}
	for _, f := range []struct{ job, name string }{{"relay", r.Relay}, {"producer", r.Producer}, {"consumer", r.Consumer}} {
		if err := checkRole(f.name); err != nil {
			return nil, fmt.Errorf("grants: %s role %q: %w", f.job, f.name, err)
		}
	}
	n := cfg.Names()
	seq := store.Ident(cfg.Schema, cfg.Table+"_id_seq") // the BIGSERIAL's sequence
	var out []string
	grant := func(privs, object, role string) {
		out = append(out, "GRANT "+privs+" ON "+object+" TO "+store.Ident(role))
	}
	if r.Relay != "" {
		grant("USAGE", "SCHEMA "+n.Schema, r.Relay)
		if r.NoRetention {
			grant("SELECT, UPDATE", "TABLE "+n.Outbox, r.Relay)
		} else {
			grant("SELECT, UPDATE, DELETE", "TABLE "+n.Outbox, r.Relay)
			grant("SELECT, UPDATE, DELETE", "TABLE "+n.Processed, r.Relay)
		}
		grant("SELECT", "TABLE "+n.Migrations, r.Relay)
		grant("EXECUTE", "FUNCTION "+n.RowCheckFunc+rowCheckArgs, r.Relay) // the row check (migration 12)
		if r.LogMode {
			// The table path claims through the handoff view, and the log
			// relay inserts log-only events it hands to the table.
			grant("SELECT, UPDATE", "TABLE "+n.HandoffView, r.Relay)
			grant("INSERT", "TABLE "+n.Outbox, r.Relay)
			grant("USAGE", "SEQUENCE "+seq, r.Relay)
			grant("SELECT, INSERT, UPDATE", "TABLE "+n.LogSlot, r.Relay) // records the slot it reads
		}
	}
	if r.Producer != "" {
		grant("USAGE", "SCHEMA "+n.Schema, r.Producer)
		grant("INSERT", "TABLE "+n.Outbox, r.Producer)
		grant("USAGE", "SEQUENCE "+seq, r.Producer)
		grant("EXECUTE", "FUNCTION "+n.EventIDFunc+"()", r.Producer) // the event_id default
		grant("EXECUTE", "FUNCTION "+n.RowCheckFunc+rowCheckArgs, r.Producer)
		for _, payload := range []string{"bytea", "text", "json", "jsonb"} {
			grant("EXECUTE", "FUNCTION "+n.WriteFunc+"(text, text, "+payload+", jsonb, text, text, timestamptz, uuid)", r.Producer)
		}
		grant("EXECUTE", "FUNCTION "+n.LogWriteFunc+"(text)", r.Producer) // log-only events (relay.mode log)
		grant("SELECT", "TABLE "+n.LogSlot, r.Producer)                   // which slot reads them (migration 13)
	}
	if r.Consumer != "" {
		grant("USAGE", "SCHEMA "+n.Schema, r.Consumer)
		grant("SELECT, INSERT, UPDATE, DELETE", "TABLE "+n.Processed, r.Consumer)
	}
	return out, nil
}

// ApplyGrants runs the statements of Grants in one transaction: all of
// them take effect or none.
func ApplyGrants(ctx context.Context, pool *pgxpool.Pool, cfg store.Config, r Roles) error {
	stmts, err := Grants(cfg, r)
	if err != nil {
		return err
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for _, s := range stmts {
			if _, err := tx.Exec(ctx, s); err != nil {
				return fmt.Errorf("%s: %w", s, err)
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("apply grants: %w", err)
	}
	return nil
}

// rowCheckArgs are the argument types of migration 12's row check.
const rowCheckArgs = "(boolean, text, text, boolean, boolean, text, text, timestamptz, jsonb)"

// checkRole accepts what PostgreSQL accepts as a role name once quoted.
func checkRole(s string) error {
	switch {
	case s == "":
		return nil
	case !utf8.ValidString(s):
		return errors.New("not valid UTF-8")
	case len(s) > 63:
		return errors.New("longer than 63 bytes")
	}
	for _, c := range s {
		if c == 0 {
			return errors.New("contains a NUL byte")
		}
	}
	return nil
}
