package brokers

import (
	"context"
	"errors"
	"net"
	"sync"
)

// ErrAborted is returned by a Sockets dial after Abort.
var ErrAborted = errors.New("connection aborted")

// Sockets keeps the TCP connections one broker link dials, so the link can
// be forced down: client libraries block in reads and writes that take no
// context, and closing their sockets is what makes those calls return.
// The zero value is ready to use.
type Sockets struct {
	mu      sync.Mutex
	conns   map[*trackedConn]struct{}
	aborted bool
	ctx     context.Context
	cancel  context.CancelFunc
}

// Wrap returns dial with every connection it makes tracked. The ctx it
// passes to dial ends with Abort, and after Abort it fails at once.
func (s *Sockets) Wrap(dial func(ctx context.Context, network, addr string) (net.Conn, error)) func(network, addr string) (net.Conn, error) {
	return func(network, addr string) (net.Conn, error) {
		ctx, err := s.context()
		if err != nil {
			return nil, err
		}
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		tc := &trackedConn{Conn: c, s: s}
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.aborted {
			_ = c.Close()
			return nil, ErrAborted
		}
		if s.conns == nil {
			s.conns = map[*trackedConn]struct{}{}
		}
		s.conns[tc] = struct{}{}
		return tc, nil
	}
}

func (s *Sockets) context() (context.Context, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.aborted {
		return nil, ErrAborted
	}
	if s.ctx == nil {
		s.ctx, s.cancel = context.WithCancel(context.Background())
	}
	return s.ctx, nil
}

// Abort closes every tracked connection, ends dials in progress and makes
// later dials fail. It does not block.
func (s *Sockets) Abort() {
	s.mu.Lock()
	s.aborted = true
	conns := s.conns
	s.conns = nil
	if s.cancel != nil {
		s.cancel()
	}
	s.mu.Unlock()
	for c := range conns {
		_ = c.Conn.Close()
	}
}

// Aborted reports whether Abort was called.
func (s *Sockets) Aborted() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.aborted
}

// Open is the number of tracked connections not yet closed.
func (s *Sockets) Open() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.conns)
}

type trackedConn struct {
	net.Conn
	s    *Sockets
	once sync.Once
}

func (c *trackedConn) Close() error {
	c.once.Do(func() {
		c.s.mu.Lock()
		delete(c.s.conns, c)
		c.s.mu.Unlock()
	})
	return c.Conn.Close()
}
