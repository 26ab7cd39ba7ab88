package admin

import (
	"errors"
	"fmt"
)

// ErrInvalid is wrapped by every error that refuses an argument of an
// Admin method (a selector, a listing's filter or limit, an event id that
// is not a UUID, a park reason), so that a caller such as an HTTP API can
// tell a bad request from a failure: errors.Is(err, ErrInvalid).
var ErrInvalid = errors.New("invalid argument")

// invalidError is an argument's error: its text is the message's alone.
type invalidError struct{ error }

func (e invalidError) Is(target error) bool { return target == ErrInvalid }

func (e invalidError) Unwrap() error { return e.error }

// invalid is fmt.Errorf for an argument's error: it wraps ErrInvalid.
func invalid(format string, args ...any) error {
	return invalidError{fmt.Errorf(format, args...)}
}
