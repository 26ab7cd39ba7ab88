package outboxcli

import (
	"fmt"
	"runtime"
	"runtime/debug"

	"github.com/spf13/cobra"
)

func init() { extraCommands = append(extraCommands, versionCmd) }

type versionJSON struct {
	Module    string `json:"module"`
	Version   string `json:"version"`
	Commit    string `json:"commit,omitempty"`
	CommitAt  string `json:"commit_time,omitempty"`
	Modified  bool   `json:"modified"`
	GoVersion string `json:"go_version"`
}

// buildVersion reads what the Go toolchain stamped into the binary: the
// module version (set by `go install module@version`, "(devel)" for a
// build in a checkout) and the VCS commit (set by `go build` in a git
// checkout).
func buildVersion(bi *debug.BuildInfo, ok bool) versionJSON {
	v := versionJSON{Version: "unknown", GoVersion: runtime.Version()}
	if !ok || bi == nil {
		return v
	}
	v.Module = bi.Main.Path
	if bi.Main.Version != "" {
		v.Version = bi.Main.Version
	}
	if bi.GoVersion != "" {
		v.GoVersion = bi.GoVersion
	}
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			v.Commit = s.Value
		case "vcs.time":
			v.CommitAt = s.Value
		case "vcs.modified":
			v.Modified = s.Value == "true"
		}
	}
	return v
}

func (v versionJSON) String() string {
	s := "outbox " + v.Version
	if v.Commit != "" {
		s += ", commit " + v.Commit
		if v.Modified {
			s += " (modified)"
		}
		if v.CommitAt != "" {
			s += " of " + v.CommitAt
		}
	}
	return s + ", " + v.GoVersion
}

func versionCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "version",
		Short: "Print the version, commit and Go version of this binary",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			v := buildVersion(debug.ReadBuildInfo())
			if asJSON {
				return writeJSON(cmd.OutOrStdout(), v)
			}
			_, err := fmt.Fprintln(cmd.OutOrStdout(), v)
			return err
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}
