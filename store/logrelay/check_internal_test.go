package logrelay

import (
	"strings"
	"testing"
)

// The start-up error for a server without wal_level=logical says what to
// change. (A running server cannot change wal_level for a test; the
// query reading it is the one TestRoleWithoutReplicationIsRefused runs.)
func TestWALLevelError(t *testing.T) {
	for _, level := range []string{"replica", "minimal"} {
		err := checkWALLevel(level)
		if err == nil || !strings.Contains(err.Error(), "wal_level="+level) || !strings.Contains(err.Error(), "wal_level=logical") {
			t.Errorf("checkWALLevel(%s) = %v", level, err)
		}
	}
	if err := checkWALLevel("logical"); err != nil {
		t.Errorf("checkWALLevel(logical) = %v", err)
	}
}
