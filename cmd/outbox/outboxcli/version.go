package outboxcli

import (
	"fmt"
	"runtime"
	"runtime/debug"
	"strings"

	"github.com/spf13/cobra"
)

func init() { extraCommands = append(extraCommands, versionCmd) }

// version is the release this binary was built as, set at build time:
//
//	go build -ldflags "-X github.com/outboxhq/outbox/cmd/outbox/outboxcli.version=v0.1.0" ./cmd/outbox
//
// (make build and the Dockerfile do). Empty, the module version that `go
// install module@version` stamps is reported instead.
var version string

type versionJSON struct {
	Module    string   `json:"module"`
	Version   string   `json:"version"`
	Commit    string   `json:"commit,omitempty"`
	CommitAt  string   `json:"commit_time,omitempty"`
	Modified  modified `json:"modified"`
	GoVersion string   `json:"go_version"`
}

// modified is whether the checkout had local changes: "true", "false", or
// "unknown" when the build recorded no VCS data (-buildvcs=false, no git).
type modified string

func (m modified) MarshalJSON() ([]byte, error) {
	if m == "true" || m == "false" {
		return []byte(m), nil
	}
	return []byte(`"unknown"`), nil
}

func (m *modified) UnmarshalJSON(b []byte) error {
	*m = modified(strings.Trim(string(b), `"`))
	return nil
}

// buildVersion reads the version set at build time (ldflags) or what the
// Go toolchain stamped into the binary: the module version (set by `go
// install module@version`, "(devel)" for a build in a checkout) and the
// VCS commit (set by `go build` in a git checkout).
func buildVersion(ldflags string, bi *debug.BuildInfo, ok bool) versionJSON {
	v := versionJSON{Version: "unknown", Modified: "unknown", GoVersion: runtime.Version()}
	if ldflags != "" {
		v.Version = ldflags
	}
	if !ok || bi == nil {
		return v
	}
	v.Module = bi.Main.Path
	if bi.Main.Version != "" && ldflags == "" {
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
			v.Modified = modified(s.Value)
		}
	}
	return v
}

func (v versionJSON) String() string {
	s := "outbox " + v.Version
	if v.Commit != "" {
		s += ", commit " + v.Commit
		if v.Modified == "true" {
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
			bi, ok := debug.ReadBuildInfo()
			v := buildVersion(version, bi, ok)
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
