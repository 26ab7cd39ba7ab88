package brokertest

import (
	"io"
	"net"
	"sync"
	"testing"
)

// Proxy forwards loopback TCP connections to a broker until Cut, which
// drops every connection and refuses new ones: a broker that went down, as
// the client sees it, without stopping a server other tests share.
type Proxy struct {
	ln     net.Listener
	target string

	mu    sync.Mutex
	conns []net.Conn
	cut   bool
	wg    sync.WaitGroup
}

// NewProxy listens on a free loopback port and forwards to target. It is
// closed when the test ends.
func NewProxy(t testing.TB, target string) *Proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("proxy listen: %v", err)
	}
	p := &Proxy{ln: ln, target: target}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.Cut)
	return p
}

// Addr is the host:port clients dial instead of the target.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Cut closes the listener and every forwarded connection, and waits for the
// forwarding goroutines to end. It is safe to call more than once.
func (p *Proxy) Cut() {
	p.mu.Lock()
	p.cut = true
	conns := p.conns
	p.conns = nil
	p.mu.Unlock()
	_ = p.ln.Close()
	for _, c := range conns {
		_ = c.Close()
	}
	p.wg.Wait()
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		in, err := p.ln.Accept()
		if err != nil {
			return
		}
		out, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = in.Close()
			continue
		}
		p.mu.Lock()
		if p.cut {
			p.mu.Unlock()
			_ = in.Close()
			_ = out.Close()
			return
		}
		p.conns = append(p.conns, in, out)
		p.wg.Add(2)
		p.mu.Unlock()
		go p.pipe(in, out)
		go p.pipe(out, in)
	}
}

func (p *Proxy) pipe(dst, src net.Conn) {
	defer p.wg.Done()
	_, _ = io.Copy(dst, src)
	// One direction ended: end the other too, as a dropped link would.
	_ = dst.Close()
	_ = src.Close()
}
