package outboxcli

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"

	"github.com/outboxhq/outbox/store/migrate"
)

func init() { extraCommands = append(extraCommands, grantsCmd) }

func grantsCmd() *cobra.Command {
	var (
		roles migrate.Roles
		apply bool
	)
	cmd := &cobra.Command{
		Use:   "grants",
		Short: "Print (or apply) least-privilege GRANTs for relay, producer and consumer roles",
		Long: "grants prints the GRANT statements that let existing roles do one job each on the outbox:\n" +
			"the relay role reads, marks and deletes (for retention) events, the producer role only inserts them,\n" +
			"the consumer role records processed events. With relay.mode log (OUTBOX_RELAY_MODE=log or the config\n" +
			"file) the relay role may also insert the events it hands to the table and claim them through the\n" +
			"handoff view; in table mode it cannot insert. With --apply they run in one transaction, as a role\n" +
			"that owns the tables (the one that ran `outbox migrate`).",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if !apply {
				// Printing needs only the table names, not a database.
				cfg, l, err := Load(cmd.Flags(), os.Environ())
				if err != nil {
					return usageError(err)
				}
				commandMasker(cmd).add(secretsOf(l.k)...)
				roles.LogMode = cfg.Relay.Mode == "log"
				stmts, err := migrate.Grants(cfg.StoreConfig(), roles)
				if err != nil {
					return usageError(err)
				}
				for _, s := range stmts {
					fmt.Fprintln(cmd.OutOrStdout(), s+";")
				}
				return nil
			}
			e, err := setup(cmd)
			if err != nil {
				return err
			}
			roles.LogMode = e.cfg.Relay.Mode == "log"
			stmts, err := migrate.Grants(e.cfg.StoreConfig(), roles)
			if err != nil {
				return err
			}
			pool, err := e.openPool(cmd.Context(), "outbox-grants")
			if err != nil {
				return err
			}
			defer pool.Close()
			if err := migrate.ApplyGrants(cmd.Context(), pool, e.cfg.StoreConfig(), roles); err != nil {
				return err
			}
			fmt.Fprintf(e.out, "applied %d grants\n", len(stmts))
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&roles.Relay, "relay-role", "", "role the relay connects as")
	f.StringVar(&roles.Producer, "producer-role", "", "role the application writes events as")
	f.StringVar(&roles.Consumer, "consumer-role", "", "role a deduplicating consumer connects as")
	f.BoolVar(&roles.NoRetention, "no-retention", false, "leave out the relay's DELETE rights (retention runs elsewhere)")
	f.BoolVar(&apply, "apply", false, "run the statements instead of printing them")
	return cmd
}
