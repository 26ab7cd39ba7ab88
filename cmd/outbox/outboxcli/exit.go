package outboxcli

import (
	"errors"
	"fmt"

	"github.com/spf13/cobra"
)

// Exit codes of the outbox binary (see the README and `outbox --help`).
const (
	ExitOK          = 0 // the command did what it was asked
	ExitFailure     = 1 // any other failure
	ExitUsage       = 2 // bad usage or configuration: unknown flag or key, invalid value
	ExitUnavailable = 3 // the database or the broker could not be reached
	ExitNoMatch     = 4 // an operator command's selection matched no event
)

const exitCodesHelp = `Exit codes:
  0  success
  1  any other failure
  2  bad usage or configuration (unknown command, flag or key, invalid value)
  3  a service is unreachable (database or broker connect or ping failed)
  4  nothing matched (retry, park, unpark, replay, stuck found no event)`

// exitError carries the exit code of a failure, decided where its kind is
// known.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// withCode wraps err with code unless err is nil or already carries one.
func withCode(code int, err error) error {
	var x *exitError
	if err == nil || errors.As(err, &x) {
		return err
	}
	return &exitError{code: code, err: err}
}

func usageError(err error) error { return withCode(ExitUsage, err) }

func usagef(format string, a ...any) error { return usageError(fmt.Errorf(format, a...)) }

// noMatch returns errNoMatch when n events were selected, none.
func noMatch(n int64) error {
	if n == 0 {
		return errNoMatch
	}
	return nil
}

func unavailable(err error) error { return withCode(ExitUnavailable, err) }

// errNoMatch is returned, after the command printed its (empty) result,
// when a selection matched no event.
var errNoMatch = &exitError{code: ExitNoMatch, err: errors.New("no event matched")}

// ExitCode returns the exit code for an error of the command line. Errors
// of a command's own run carry their code, ExitFailure when none was set
// where the failure happened; any other error comes from parsing the
// command line (unknown command or flag, wrong arguments): ExitUsage.
func ExitCode(err error) int {
	if err == nil {
		return ExitOK
	}
	var x *exitError
	if errors.As(err, &x) {
		return x.code
	}
	return ExitUsage
}

// classifyCommands gives each error a command's run returns without a code
// the code ExitFailure, so that only the parser's errors are left without
// one.
func classifyCommands(c *cobra.Command) {
	if run := c.RunE; run != nil {
		c.RunE = func(cmd *cobra.Command, args []string) error {
			return withCode(ExitFailure, run(cmd, args))
		}
	}
	for _, sub := range c.Commands() {
		classifyCommands(sub)
	}
}
