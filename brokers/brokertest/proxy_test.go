package brokertest_test

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/outboxhq/outbox/brokers/brokertest"
)

// echo serves a loopback echo server until the test ends.
func echo(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { _ = ln.Close(); <-done })
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(c, c); _ = c.Close() }()
		}
	}()
	return ln.Addr().String()
}

// roundTrip writes msg and reads it back within d; it reports the bytes
// read and the read error.
func roundTrip(t *testing.T, c net.Conn, msg string, d time.Duration) (string, error) {
	t.Helper()
	if _, err := c.Write([]byte(msg)); err != nil {
		return "", err
	}
	return read(c, len(msg), d)
}

func read(c net.Conn, n int, d time.Duration) (string, error) {
	_ = c.SetReadDeadline(time.Now().Add(d))
	buf := make([]byte, n)
	got, err := io.ReadFull(c, buf)
	return string(buf[:got]), err
}

func dial(t *testing.T, p *brokertest.Proxy) net.Conn {
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func TestProxyStallHoldsBytesUntilHeal(t *testing.T) {
	p := brokertest.NewProxy(t, echo(t))
	c := dial(t, p)
	if got, err := roundTrip(t, c, "a", time.Second); err != nil || got != "a" {
		t.Fatalf("forward: %q %v", got, err)
	}
	p.SetMode(brokertest.Stall)
	if got, err := roundTrip(t, c, "b", 200*time.Millisecond); err == nil {
		t.Fatalf("stalled proxy answered %q", got)
	}
	late := dial(t, p) // accepted while stalled
	if _, err := late.Write([]byte("c")); err != nil {
		t.Fatal(err)
	}
	p.Heal()
	if got, err := read(c, 1, time.Second); err != nil || got != "b" {
		t.Fatalf("after heal the stalled bytes: %q %v", got, err)
	}
	if got, err := read(late, 1, time.Second); err != nil || got != "c" {
		t.Fatalf("after heal the connection made while stalled: %q %v", got, err)
	}
}

func TestProxyBlackHoleAndHalfOpen(t *testing.T) {
	for _, m := range []brokertest.Mode{brokertest.BlackHole, brokertest.HalfOpen} {
		t.Run(m.String(), func(t *testing.T) {
			p := brokertest.NewProxy(t, echo(t))
			c := dial(t, p)
			if _, err := roundTrip(t, c, "a", time.Second); err != nil {
				t.Fatal(err)
			}
			p.SetMode(m)
			if got, err := roundTrip(t, c, "b", 200*time.Millisecond); err == nil {
				t.Fatalf("%v proxy answered %q", m, got)
			}
			fresh := dial(t, p) // the TCP handshake still succeeds
			if got, err := roundTrip(t, fresh, "c", 200*time.Millisecond); err == nil {
				t.Fatalf("%v proxy answered a new connection: %q", m, got)
			}
			p.Heal()
			// Both connections lost bytes or never reached the broker:
			// they are reset, and new ones work.
			for _, old := range []net.Conn{c, fresh} {
				if _, err := read(old, 1, time.Second); err == nil {
					t.Fatal("a connection that lost bytes carried on after heal")
				} else if ne, ok := err.(net.Error); ok && ne.Timeout() {
					t.Fatal("a connection that lost bytes was left open after heal")
				}
			}
			if got, err := roundTrip(t, dial(t, p), "d", time.Second); err != nil || got != "d" {
				t.Fatalf("after heal: %q %v", got, err)
			}
		})
	}
}

// Down resets the connections it has and each new one, as a broker that
// went away; after Heal new connections reach the broker again.
func TestProxyDown(t *testing.T) {
	p := brokertest.NewProxy(t, echo(t))
	c := dial(t, p)
	if _, err := roundTrip(t, c, "a", time.Second); err != nil {
		t.Fatal(err)
	}
	p.SetMode(brokertest.Down)
	if _, err := read(c, 1, time.Second); err == nil {
		t.Fatal("a connection carried on while the proxy was down")
	} else if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatal("a connection was left open while the proxy was down")
	}
	if got, err := roundTrip(t, dial(t, p), "b", time.Second); err == nil {
		t.Fatalf("a proxy that is down answered a new connection: %q", got)
	} else if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatal("a new connection was left open while the proxy was down")
	}
	p.Heal()
	if got, err := roundTrip(t, dial(t, p), "c", time.Second); err != nil || got != "c" {
		t.Fatalf("after heal: %q %v", got, err)
	}
}

// TargetPorts are the client ports the target sees: how a caller tells
// which of the target's sessions came through which proxy.
func TestProxyTargetPorts(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	seen := make(chan int32, 1)
	done := make(chan struct{})
	t.Cleanup(func() { _ = ln.Close(); <-done })
	go func() {
		defer close(done)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		seen <- int32(c.RemoteAddr().(*net.TCPAddr).Port)
		_, _ = io.Copy(c, c)
		_ = c.Close()
	}()
	p := brokertest.NewProxy(t, ln.Addr().String())
	if got := p.TargetPorts(); len(got) != 0 {
		t.Fatalf("ports before any connection: %v", got)
	}
	c := dial(t, p)
	if got, err := roundTrip(t, c, "a", time.Second); err != nil || got != "a" {
		t.Fatalf("forward: %q %v", got, err)
	}
	port := <-seen
	if got := p.TargetPorts(); len(got) != 1 || got[0] != port {
		t.Fatalf("TargetPorts %v, the target saw port %d", got, port)
	}
}
