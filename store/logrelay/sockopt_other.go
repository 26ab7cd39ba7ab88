//go:build !linux

package logrelay

import (
	"syscall"
	"time"
)

// setUserTimeout does nothing where TCP_USER_TIMEOUT is not available:
// keepalives and the receive deadline remain.
func setUserTimeout(syscall.RawConn, time.Duration) error { return nil }
