package outboxcli

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"

	"github.com/spf13/cobra"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/store/table"
)

// `outbox console`: the operator console and its API for a host that runs
// no relay, such as an operator's machine or a small deployment of its own.

func init() { extraCommands = append(extraCommands, consoleCmd) }

func consoleCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "console",
		Short: "Serve the operator console and its JSON API, without a relay",
		Long: "console serves the operator console (/console/) and its JSON API (/api/v1/) on http.listen\n" +
			"(--http-listen), with /healthz and /readyz, until stopped. It needs the console's credentials\n" +
			"(console.token, console.username and console.password, from the environment) or\n" +
			"console.anonymous_reads; console.enabled is for `outbox relay`. docs/operations.md describes\n" +
			"the pages and the API.",
		Example: "  OUTBOX_CONSOLE_USERNAME=ops OUTBOX_CONSOLE_PASSWORD=... outbox console --http-listen 127.0.0.1:8080",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			e, err := setup(cmd)
			if err != nil {
				return err
			}
			if e.cfg.HTTP.Listen == "" {
				return usagef("http.listen: set the address to serve the console on (--http-listen 127.0.0.1:8080)")
			}
			if errs := e.cfg.Console.validate(true); len(errs) > 0 {
				return usagef("invalid configuration:\n%w", errors.Join(errs...))
			}
			ctx := cmd.Context()
			st, err := e.openStore(ctx, "outbox-console")
			if err != nil {
				return err
			}
			defer st.Pool().Close()
			return e.serveConsole(ctx, st)
		},
	}
	cmd.Flags().String("http-listen", "", "address to serve the console on, such as 127.0.0.1:8080")
	return cmd
}

func (e *app) serveConsole(ctx context.Context, st *table.Source) error {
	con, err := e.newConsole(st, nil)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", e.cfg.HTTP.Listen)
	if err != nil {
		return unavailable(fmt.Errorf("http.listen %s: %w", e.cfg.HTTP.Listen, err))
	}
	mux := http.NewServeMux()
	healthHandlers(mux, func(ctx context.Context) []core.Check {
		// /readyz shows the failure, which may quote a connection setting.
		return []core.Check{{Name: "database", Err: e.mask.error(st.Ping(ctx))}}
	}, e.log)
	mountConsole(mux, con)
	done := serveHTTP(ctx, e, ln, mux)
	e.log.Info("console listening", "addr", ln.Addr().String(), "paths", "/console/ /api/v1/ /healthz /readyz",
		"read_only", e.cfg.Console.ReadOnly, "anonymous_reads", e.cfg.Console.AnonymousReads)
	<-done
	e.log.Info("console stopped")
	return nil
}
