package logrelay

import (
	"context"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/outboxhq/outbox/internal/pgtest"
)

// The replication connection has keepalives and TCP_USER_TIMEOUT set to
// the receive timeout: a relay that reads nothing (back-pressured by its
// broker) still learns that the server is gone when its status updates
// go unacknowledged, instead of after TCP's own retransmissions give up.
func TestReplicationConnTCPTimeouts(t *testing.T) {
	pgtest.Logical(t)
	pool := pgtest.NewPool(t)
	conn, err := replicationConn(context.Background(), pool, nil, 7*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	tc, ok := conn.Conn().(*net.TCPConn)
	if !ok {
		t.Skipf("connection is %T, not TCP", conn.Conn())
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var userTimeout, keepalive int
	var serr error
	if err := rc.Control(func(fd uintptr) {
		if userTimeout, serr = unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT); serr != nil {
			return
		}
		keepalive, serr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_KEEPALIVE)
	}); err != nil || serr != nil {
		t.Fatal(err, serr)
	}
	if userTimeout != 7000 || keepalive != 1 {
		t.Fatalf("TCP_USER_TIMEOUT %dms, SO_KEEPALIVE %d; want 7000 and 1", userTimeout, keepalive)
	}
}
