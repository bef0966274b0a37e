package redistest

import (
	"bytes"
	"context"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Faults injects network faults between a Redis client and its server, for
// tests of what a client does when a reply is lost or Redis is cut off. It
// works two ways: as a go-redis Dialer wrapper (Dialer), which also covers
// every node of a cluster client, and as a loopback TCP proxy (Proxy) that
// a separate process or an URL-configured client can be pointed at.
type Faults struct {
	mu    sync.Mutex
	match []byte // armed: the next request containing it loses its reply
	lost  atomic.Int64
	cut   atomic.Bool
	conns map[net.Conn]struct{}
}

// NewFaults returns an idle fault injector.
func NewFaults() *Faults { return &Faults{conns: map[net.Conn]struct{}{}} }

// LoseNextReply arms the injector: the reply to the next request whose
// bytes contain match (for example "EVALSHA", or a key name) is swallowed,
// as if the network lost it after Redis applied the command. The client
// then times out and, by its retry policy, sends the command again.
func (f *Faults) LoseNextReply(match string) {
	f.mu.Lock()
	f.match = []byte(match)
	f.mu.Unlock()
}

// Lost reports how many replies were swallowed.
func (f *Faults) Lost() int64 { return f.lost.Load() }

// Cut makes the link dead: open connections are closed and new ones are
// refused until Restore. To the client this is a Redis outage.
func (f *Faults) Cut() {
	f.cut.Store(true)
	f.mu.Lock()
	conns := make([]net.Conn, 0, len(f.conns))
	for c := range f.conns {
		conns = append(conns, c)
	}
	f.mu.Unlock()
	// Closed outside the lock: closing a conn untracks it.
	for _, c := range conns {
		_ = c.Close()
	}
}

// Restore ends a Cut.
func (f *Faults) Restore() { f.cut.Store(false) }

// errCut is what a dial returns while the link is cut.
var errCut = errors.New("redistest: link cut by the test")

// take reports whether a request of these bytes is the armed one, and
// disarms it.
func (f *Faults) take(p []byte) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.match == nil || !bytes.Contains(p, f.match) {
		return false
	}
	f.match = nil
	return true
}

func (f *Faults) track(c net.Conn) {
	f.mu.Lock()
	f.conns[c] = struct{}{}
	f.mu.Unlock()
}

func (f *Faults) untrack(c net.Conn) {
	f.mu.Lock()
	delete(f.conns, c)
	f.mu.Unlock()
}

// Dialer wraps a go-redis Dialer (nil: a plain TCP dial) so every
// connection it makes is subject to the faults.
func (f *Faults) Dialer(next func(ctx context.Context, network, addr string) (net.Conn, error)) func(ctx context.Context, network, addr string) (net.Conn, error) {
	if next == nil {
		var d net.Dialer
		next = d.DialContext
	}
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		if f.cut.Load() {
			return nil, errCut
		}
		c, err := next(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		fc := &faultConn{Conn: c, f: f}
		f.track(fc)
		return fc, nil
	}
}

// faultConn swallows the reply that follows an armed request.
type faultConn struct {
	net.Conn
	f       *Faults
	swallow atomic.Bool
}

func (c *faultConn) Write(p []byte) (int, error) {
	if c.f.cut.Load() {
		return 0, errCut
	}
	if c.f.take(p) {
		c.swallow.Store(true)
	}
	return c.Conn.Write(p)
}

func (c *faultConn) Read(p []byte) (int, error) {
	for {
		// The flag is looked at once bytes came back, not before the read:
		// the proxy's reader is already blocked here when the armed request
		// is written, and the first bytes after it are that request's reply
		// (a client sends its next command only after reading the last reply).
		n, err := c.Conn.Read(p)
		if n == 0 || !c.swallow.CompareAndSwap(true, false) {
			return n, err
		}
		// Discard what Redis answered, then read on: nothing else comes,
		// so the client's own read deadline ends the wait, as it would
		// for a reply lost on the wire.
		c.f.lost.Add(1)
		if err != nil {
			return 0, err
		}
	}
}

func (c *faultConn) Close() error {
	c.f.untrack(c)
	return c.Conn.Close()
}

// Proxy is a loopback TCP proxy to a Redis server, subject to Faults.
type Proxy struct {
	*Faults
	ln     net.Listener
	target string
	wg     sync.WaitGroup
}

// StartProxy listens on a free loopback port and forwards to target
// (host:port) until the test ends.
func StartProxy(t testing.TB, target string) *Proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &Proxy{Faults: NewFaults(), ln: ln, target: target}
	p.wg.Add(1)
	go p.serve()
	t.Cleanup(func() {
		_ = ln.Close()
		p.Cut()
		p.wg.Wait()
	})
	return p
}

// Addr is the proxy's host:port; URL its redis:// URL.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// URL is the redis:// address of the proxy.
func (p *Proxy) URL() string { return "redis://" + p.Addr() }

func (p *Proxy) serve() {
	defer p.wg.Done()
	dial := p.Dialer(nil)
	for {
		in, err := p.ln.Accept()
		if err != nil {
			return
		}
		if p.cut.Load() {
			_ = in.Close()
			continue
		}
		out, err := dial(context.Background(), "tcp", p.target)
		if err != nil {
			_ = in.Close()
			continue
		}
		p.track(in)
		p.wg.Add(2)
		go p.pipe(out, in) // client → server: Write on the fault conn arms swallowing
		go p.pipe(in, out) // server → client: Read on the fault conn swallows
	}
}

// pipe copies src to dst until either side closes, then closes both.
func (p *Proxy) pipe(dst, src net.Conn) {
	defer p.wg.Done()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				break
			}
		}
		if err != nil {
			break
		}
	}
	_ = dst.Close()
	_ = src.Close()
	p.untrack(dst)
	p.untrack(src)
}

// waitFor polls cond until it holds or d passes; it reports whether it held.
// Tests use it to wait for a real event (a process, a port), never as a
// substitute for synchronisation they control.
func waitFor(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if cond() {
			return true
		}
		time.Sleep(10 * time.Millisecond)
	}
	return cond()
}
