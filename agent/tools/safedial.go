package tools

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"syscall"
	"time"

	"faregate/agent/outbound"
)

// ErrForbiddenAddress refuses a destination that is not on the public
// internet: fetch_page must not become a way into the operator's network or
// the cloud metadata service.
var ErrForbiddenAddress = errors.New("tools: destination is not a public address")

// ErrNoAddress reports a host name that resolved to nothing.
var ErrNoAddress = errors.New("tools: host has no address")

// Policy decides which addresses fetch_page may dial.
type Policy struct {
	// Allow approves an address; nil means IsPublic. Tests use it to let
	// a loopback test server through.
	Allow func(netip.Addr) bool
	// Resolver resolves host names (net.DefaultResolver when nil).
	Resolver *net.Resolver
	// LookupIP, when set, replaces Resolver; tests use it to make
	// "evil.test" resolve to a private address without any DNS traffic.
	LookupIP func(ctx context.Context, host string) ([]netip.Addr, error)
}

// SafeTransport returns the base transport for fetch_page. It resolves
// names itself, refuses the connection if any address is not allowed, and
// dials the checked address directly, checking it once more in the dialer's
// Control hook. The address tested is the address connected to, so DNS
// rebinding and redirects towards internal hosts fail the same way as a
// literal private URL. No proxy is used: a proxy would dial on our behalf
// where the check cannot see.
func SafeTransport(p Policy) *http.Transport {
	g := &guard{p: p}
	g.dialer = &net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second, ControlContext: g.control}
	return &http.Transport{
		Proxy:                  nil,
		DialContext:            g.dial,
		ForceAttemptHTTP2:      true,
		MaxIdleConns:           32,
		MaxIdleConnsPerHost:    2,
		IdleConnTimeout:        30 * time.Second,
		TLSHandshakeTimeout:    5 * time.Second,
		ExpectContinueTimeout:  time.Second,
		MaxResponseHeaderBytes: 64 << 10,
	}
}

type guard struct {
	p      Policy
	dialer *net.Dialer
}

func (g *guard) allowed(a netip.Addr) bool {
	a = a.WithZone("").Unmap()
	if g.p.Allow != nil {
		return g.p.Allow(a)
	}
	return IsPublic(a)
}

func forbidden(host string) error {
	// ErrPermanent tells the outbound session that retrying is pointless.
	return fmt.Errorf("%w (%w): %s", ErrForbiddenAddress, outbound.ErrPermanent, host)
}

// dial resolves, checks every address before any connection is attempted,
// then connects to the checked addresses in order.
func (g *guard) dial(ctx context.Context, network, address string) (net.Conn, error) {
	host, port, err := net.SplitHostPort(address)
	if err != nil {
		return nil, fmt.Errorf("tools: dial %s: %w", address, err)
	}
	addrs, err := g.resolve(ctx, host)
	if err != nil {
		return nil, err
	}
	// One private answer taints the name: a host that mixes public and
	// internal addresses is either misconfigured or an attack.
	for _, a := range addrs {
		if !g.allowed(a) {
			return nil, forbidden(host)
		}
	}
	var first error
	for _, a := range addrs {
		conn, err := g.dialer.DialContext(ctx, network, net.JoinHostPort(a.WithZone("").Unmap().String(), port))
		if err == nil {
			return conn, nil
		}
		if first == nil {
			first = err
		}
		if errors.Is(err, ErrForbiddenAddress) || ctx.Err() != nil {
			break
		}
	}
	return nil, first
}

func (g *guard) resolve(ctx context.Context, host string) ([]netip.Addr, error) {
	if a, err := netip.ParseAddr(host); err == nil {
		return []netip.Addr{a}, nil
	}
	var addrs []netip.Addr
	var err error
	switch {
	case g.p.LookupIP != nil:
		addrs, err = g.p.LookupIP(ctx, host)
	case g.p.Resolver != nil:
		addrs, err = g.p.Resolver.LookupNetIP(ctx, "ip", host)
	default:
		addrs, err = net.DefaultResolver.LookupNetIP(ctx, "ip", host)
	}
	if err != nil {
		return nil, err
	}
	if len(addrs) == 0 {
		return nil, fmt.Errorf("%w (%w): %s", ErrNoAddress, outbound.ErrPermanent, host)
	}
	return addrs, nil
}

// control runs after the socket exists and before it connects: the last
// word on the address actually dialled.
func (g *guard) control(_ context.Context, _, address string, _ syscall.RawConn) error {
	ap, err := netip.ParseAddrPort(address)
	if err != nil || !g.allowed(ap.Addr()) {
		return forbidden(address)
	}
	return nil
}

// Address blocks that are never public. IPv4-mapped IPv6 addresses are
// unmapped before the check, and NAT64 addresses are checked by the IPv4
// address they embed.
var (
	blocked4 = prefixes(
		"0.0.0.0/8",          // "this network", includes the unspecified address
		"10.0.0.0/8",         // RFC 1918 private
		"100.64.0.0/10",      // carrier-grade NAT
		"127.0.0.0/8",        // loopback
		"169.254.0.0/16",     // link-local, includes 169.254.169.254 metadata
		"172.16.0.0/12",      // RFC 1918 private
		"192.0.0.0/24",       // IETF protocol assignments
		"192.0.2.0/24",       // documentation TEST-NET-1
		"192.88.99.0/24",     // deprecated 6to4 relay anycast
		"192.168.0.0/16",     // RFC 1918 private
		"198.18.0.0/15",      // benchmarking
		"198.51.100.0/24",    // documentation TEST-NET-2
		"203.0.113.0/24",     // documentation TEST-NET-3
		"224.0.0.0/4",        // multicast
		"240.0.0.0/4",        // reserved, includes broadcast 255.255.255.255
		"255.255.255.255/32", // broadcast (inside 240/4, listed for clarity)
	)
	blocked6 = prefixes(
		"::/128",         // unspecified
		"::1/128",        // loopback
		"::/96",          // deprecated IPv4-compatible
		"64:ff9b:1::/48", // local-use NAT64
		"100::/64",       // discard-only
		"2001::/23",      // IETF protocol assignments, includes Teredo
		"2001:db8::/32",  // documentation
		"2002::/16",      // 6to4: embeds an IPv4 address we will not chase
		"3fff::/20",      // documentation
		"fc00::/7",       // unique local, includes fd00:ec2::254 metadata
		"fe80::/10",      // link-local
		"fec0::/10",      // deprecated site-local
		"ff00::/8",       // multicast
	)
	nat64     = netip.MustParsePrefix("64:ff9b::/96")
	global6   = netip.MustParsePrefix("2000::/3")
	metadata6 = netip.MustParseAddr("fd00:ec2::254")
)

func prefixes(ss ...string) []netip.Prefix {
	out := make([]netip.Prefix, len(ss))
	for i, s := range ss {
		out[i] = netip.MustParsePrefix(s)
	}
	return out
}

// IsPublic reports whether a is a globally routable unicast address that
// fetch_page may connect to.
func IsPublic(a netip.Addr) bool {
	if !a.IsValid() {
		return false
	}
	a = a.WithZone("").Unmap()
	if a.Is4() {
		for _, p := range blocked4 {
			if p.Contains(a) {
				return false
			}
		}
		return true
	}
	if nat64.Contains(a) {
		b := a.As16()
		return IsPublic(netip.AddrFrom4([4]byte{b[12], b[13], b[14], b[15]}))
	}
	if a == metadata6 {
		return false
	}
	for _, p := range blocked6 {
		if p.Contains(a) {
			return false
		}
	}
	// Everything outside 2000::/3 is unassigned or special-purpose.
	return global6.Contains(a)
}
