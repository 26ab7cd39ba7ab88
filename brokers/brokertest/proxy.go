package brokertest

import (
	"errors"
	"net"
	"sync"
	"testing"
)

// Mode is what a Proxy does with the bytes between client and broker.
type Mode int

const (
	// Forward passes bytes both ways.
	Forward Mode = iota
	// Stall moves no bytes either way and keeps every connection open;
	// new ones are accepted and stalled too. What was sent waits in the
	// socket buffers and flows on Heal, as with a broker process that is
	// frozen (SIGSTOP) and resumed.
	Stall
	// BlackHole accepts and reads, never answers: bytes from the client
	// are thrown away, nothing comes back, no connection is closed. On
	// Heal the connections it swallowed bytes of are reset.
	BlackHole
	// HalfOpen reads nothing and answers nothing on the connections it
	// has, as when the broker's host vanished without a FIN; new
	// connections are accepted and left unread. On Heal they are reset,
	// as the peer that lost them would.
	HalfOpen
	// Down resets every connection and every new one at once, as a
	// broker whose process went away (its port closed) does to its
	// clients; on Heal it accepts again. What the broker holds is kept,
	// as a restarted broker keeps its log.
	Down
)

func (m Mode) String() string {
	switch m {
	case Forward:
		return "forward"
	case Stall:
		return "stall"
	case BlackHole:
		return "black-hole"
	case HalfOpen:
		return "half-open"
	case Down:
		return "down"
	}
	return "unknown"
}

// Proxy forwards loopback TCP connections to a broker. SetMode makes it
// stall, black-hole or half-open them; Cut drops every connection and
// refuses new ones: a broker that went down, as the client sees it,
// without touching a server other tests share.
type Proxy struct {
	ln     net.Listener
	target string

	mu      sync.Mutex
	mode    Mode
	changed chan struct{} // closed and replaced on each mode change
	conns   map[*pair]struct{}
	cut     bool
	wg      sync.WaitGroup
}

// pair is one client connection and, when forwarding, its broker side.
type pair struct {
	in, out net.Conn // out is nil for a connection accepted in BlackHole or HalfOpen
	lost    bool     // bytes were swallowed: it cannot carry on after Heal
}

// NewProxy listens on a free loopback port and forwards to target. It is
// closed when the test ends.
func NewProxy(t testing.TB, target string) *Proxy {
	t.Helper()
	p, err := Listen(target)
	if err != nil {
		t.Fatalf("proxy: %v", err)
	}
	t.Cleanup(p.Cut)
	return p
}

// Listen is NewProxy for use outside tests; the caller calls Cut.
func Listen(target string) (*Proxy, error) { return ListenOn("127.0.0.1:0", target) }

// ListenOn is Listen on the loopback address addr: a server that appears
// late at an address a client already dials.
func ListenOn(addr, target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	p := &Proxy{ln: ln, target: target, changed: make(chan struct{}), conns: map[*pair]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the host:port clients dial instead of the target.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Advertise wraps a broker's listener so that it reports the proxy's
// address as its own: a broker that tells clients where to connect (Kafka's
// metadata, kfake's listeners) then sends them through the proxy.
func (p *Proxy) Advertise(ln net.Listener) net.Listener { return advertised{Listener: ln, proxy: p} }

type advertised struct {
	net.Listener
	proxy *Proxy
}

func (a advertised) Addr() net.Addr { return a.proxy.ln.Addr() }

// SetMode switches what the proxy does from now on, for the connections it
// has and those to come; Down closes those it has.
func (p *Proxy) SetMode(m Mode) {
	p.mu.Lock()
	if p.mode == m {
		p.mu.Unlock()
		return
	}
	p.mode = m
	close(p.changed)
	p.changed = make(chan struct{})
	var dead []*pair
	if m == Down {
		for c := range p.conns {
			dead = append(dead, c)
		}
		clear(p.conns)
	}
	p.mu.Unlock()
	for _, c := range dead {
		c.close()
	}
}

// Heal goes back to Forward. Connections that cannot carry on (bytes were
// swallowed, or the broker side never existed) are reset; stalled ones
// resume with what waited in their buffers.
func (p *Proxy) Heal() {
	p.mu.Lock()
	var dead []*pair
	for c := range p.conns {
		if c.lost || c.out == nil || p.mode == HalfOpen {
			dead = append(dead, c)
			delete(p.conns, c)
		}
	}
	p.mode = Forward
	close(p.changed)
	p.changed = make(chan struct{})
	p.mu.Unlock()
	for _, c := range dead {
		c.close()
	}
}

// TargetPorts lists the local ports of the proxy's connections to its
// target: the client ports the target sees.
func (p *Proxy) TargetPorts() []int32 {
	p.mu.Lock()
	defer p.mu.Unlock()
	var ports []int32
	for c := range p.conns {
		if c.out == nil {
			continue
		}
		if a, ok := c.out.LocalAddr().(*net.TCPAddr); ok {
			ports = append(ports, int32(a.Port))
		}
	}
	return ports
}

// Mode is the current mode.
func (p *Proxy) Mode() Mode {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.mode
}

// Cut closes the listener and every connection, and waits for the
// forwarding goroutines to end. It is safe to call more than once.
func (p *Proxy) Cut() {
	p.mu.Lock()
	p.cut = true
	conns := p.conns
	p.conns = map[*pair]struct{}{}
	close(p.changed) // wake every waiting pipe
	p.changed = make(chan struct{})
	p.mu.Unlock()
	_ = p.ln.Close()
	for c := range conns {
		c.close()
	}
	p.wg.Wait()
}

func (c *pair) close() {
	_ = c.in.Close()
	if c.out != nil {
		_ = c.out.Close()
	}
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		in, err := p.ln.Accept()
		if err != nil {
			return
		}
		c := &pair{in: in}
		m := p.Mode()
		if m == Down {
			_ = in.Close()
			continue
		}
		if m == Forward || m == Stall {
			// A stalled broker still completes the TCP handshake (its
			// kernel does); only the process is not reading.
			if c.out, err = net.Dial("tcp", p.target); err != nil {
				_ = in.Close()
				continue
			}
		}
		p.mu.Lock()
		if p.cut {
			p.mu.Unlock()
			c.close()
			return
		}
		p.conns[c] = struct{}{}
		if c.out != nil {
			p.wg.Add(2)
			go p.pipe(c, c.out, c.in)
			go p.pipe(c, c.in, c.out)
		} else {
			p.wg.Add(1)
			go p.swallow(c)
		}
		p.mu.Unlock()
	}
}

// gate waits until the mode lets src be read, and says what to do with
// what is read: deliver it or throw it away. False means the connection is
// gone.
func (p *Proxy) gate(c *pair) (deliver, ok bool) {
	for {
		p.mu.Lock()
		if _, live := p.conns[c]; !live || p.cut {
			p.mu.Unlock()
			return false, false
		}
		mode, changed := p.mode, p.changed
		p.mu.Unlock()
		switch mode {
		case Forward:
			return true, true
		case BlackHole:
			return false, true
		case Down:
			return false, false
		}
		<-changed // Stall, HalfOpen: read nothing until the mode changes
	}
}

func (p *Proxy) pipe(c *pair, dst, src net.Conn) {
	defer p.wg.Done()
	defer func() {
		// One direction ended: end the other too, as a dropped link would.
		p.mu.Lock()
		delete(p.conns, c)
		p.mu.Unlock()
		c.close()
	}()
	buf := make([]byte, 32<<10)
	for {
		if _, ok := p.gate(c); !ok {
			return
		}
		n, err := src.Read(buf)
		if n > 0 {
			// Bytes read under one mode may meet another: hold them
			// while stalled, drop them in a black hole.
			deliver, ok := p.gate(c)
			if !ok {
				return
			}
			if deliver {
				if _, werr := dst.Write(buf[:n]); werr != nil {
					return
				}
			} else {
				p.mu.Lock()
				c.lost = true
				p.mu.Unlock()
			}
		}
		if err != nil {
			return
		}
	}
}

// swallow serves a connection that has no broker side: it reads and
// drops in BlackHole, reads nothing otherwise, until it is closed.
func (p *Proxy) swallow(c *pair) {
	defer p.wg.Done()
	buf := make([]byte, 32<<10)
	for {
		p.mu.Lock()
		_, live := p.conns[c]
		mode, changed, cut := p.mode, p.changed, p.cut
		p.mu.Unlock()
		if !live || cut || mode == Down {
			c.close()
			return
		}
		if mode != BlackHole {
			<-changed
			continue
		}
		if _, err := c.in.Read(buf); err != nil {
			if !errors.Is(err, net.ErrClosed) {
				p.mu.Lock()
				delete(p.conns, c)
				p.mu.Unlock()
			}
			c.close()
			return
		}
	}
}
