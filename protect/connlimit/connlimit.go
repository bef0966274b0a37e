// Package connlimit bounds the connections one process holds: in all, and
// per peer address, so one client holding thousands of connections hurts
// only itself. A connection past a limit is still accepted and marked, so
// the HTTP server can answer its first request with a proper 503
// server_busy and close it; past twice the process limit, connections are
// closed at once, unanswered, because even answering costs a goroutine.
package connlimit

import (
	"context"
	"net"
	"net/netip"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"faregate/protect/codes"
	"faregate/protect/kit/promreg"
)

// Options configure a Listener.
type Options struct {
	// Max is the most connections the process serves at once (0: no limit).
	Max int
	// PerPeer is the most connections one peer address (an IPv4 address or
	// an IPv6 /64) may hold (0: no limit). Peers in Exempt are not limited:
	// behind a proxy, every visitor arrives through its few addresses.
	PerPeer int
	// Exempt reports peers that are not limited per peer (trusted proxies).
	Exempt func(netip.Addr) bool
	// Registerer receives faregate_connections_open and
	// faregate_connections_refused_total{limit}.
	Registerer prometheus.Registerer
}

// Listener wraps a net.Listener with the limits. Use its ConnContext as
// http.Server.ConnContext so handlers can see Refused.
type Listener struct {
	net.Listener
	o Options

	mu     sync.Mutex
	open   int
	byPeer map[netip.Addr]int

	gauge   prometheus.Gauge
	refused *prometheus.CounterVec
}

// Wrap returns ln with the limits of o.
func Wrap(ln net.Listener, o Options) *Listener {
	l := &Listener{Listener: ln, o: o, byPeer: map[netip.Addr]int{}}
	l.gauge = promreg.Register(o.Registerer, prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "faregate_connections_open", Help: "Client connections this process holds.",
	}))
	l.refused = promreg.Register(o.Registerer, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "faregate_connections_refused_total", Help: "Connections answered 503 " + codes.ServerBusy + " (or closed) by the connection limits.",
	}, []string{"limit"}))
	// Every series exists at 0 from the start, so rate() sees the first refusal.
	for _, limit := range []string{"process", "peer", "hard"} {
		l.refused.WithLabelValues(limit)
	}
	return l
}

// Accept returns the next connection, marked when it is over a limit.
func (l *Listener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		peer := peerOf(c)
		l.mu.Lock()
		if l.o.Max > 0 && l.open >= 2*l.o.Max {
			l.mu.Unlock()
			l.refused.WithLabelValues("hard").Inc()
			_ = c.Close()
			continue
		}
		over := ""
		switch {
		case l.o.Max > 0 && l.open >= l.o.Max:
			over = "process"
		case l.o.PerPeer > 0 && peer.IsValid() && (l.o.Exempt == nil || !l.o.Exempt(peer)) && l.byPeer[peer] >= l.o.PerPeer:
			over = "peer"
		}
		l.open++
		if peer.IsValid() {
			l.byPeer[peer]++
		}
		l.mu.Unlock()
		l.gauge.Inc()
		if over != "" {
			l.refused.WithLabelValues(over).Inc()
		}
		return &conn{Conn: c, l: l, peer: peer, refused: over != ""}, nil
	}
}

// Open reports the connections held now.
func (l *Listener) Open() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.open
}

func (l *Listener) release(peer netip.Addr) {
	l.mu.Lock()
	l.open--
	if peer.IsValid() {
		if n := l.byPeer[peer] - 1; n > 0 {
			l.byPeer[peer] = n
		} else {
			delete(l.byPeer, peer)
		}
	}
	l.mu.Unlock()
	l.gauge.Dec()
}

// peerOf is the connection's peer as counted: IPv4 per address, IPv6 per
// /64, like visitors.
func peerOf(c net.Conn) netip.Addr {
	ap, err := netip.ParseAddrPort(c.RemoteAddr().String())
	if err != nil {
		return netip.Addr{}
	}
	a := ap.Addr().Unmap()
	if a.Is6() {
		p, _ := a.Prefix(64)
		return p.Addr()
	}
	return a
}

type conn struct {
	net.Conn
	l       *Listener
	peer    netip.Addr
	refused bool
	once    sync.Once
}

func (c *conn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() { c.l.release(c.peer) })
	return err
}

type ctxKey struct{}

// ConnContext marks the context of a connection over a limit; install it
// as http.Server.ConnContext.
func (l *Listener) ConnContext(ctx context.Context, c net.Conn) context.Context {
	if cc, ok := c.(*conn); ok && cc.refused {
		return context.WithValue(ctx, ctxKey{}, true)
	}
	return ctx
}

// Refused reports whether the request arrived on a connection over a limit:
// the handler answers 503 server_busy and closes it.
func Refused(ctx context.Context) bool {
	v, _ := ctx.Value(ctxKey{}).(bool)
	return v
}
