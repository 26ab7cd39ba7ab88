package cli

import "github.com/spf13/cobra"

func demoCmd() *cobra.Command {
	return &cobra.Command{Use: "demo", Short: "Run the end-to-end demo", RunE: func(cmd *cobra.Command, _ []string) error { return nil }}
}
