// Package clientip decides who a visitor is: the TCP peer, or the address a
// trusted proxy names in a forwarding header. The visitor leaves this package
// only as an HMAC key, so a raw client IP cannot end up in Redis, a log line,
// a metric label or a response by accident.
package clientip

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"log/slog"
	"net/http"
	"net/netip"
	"net/textproto"
	"strings"
	"sync"

	"faregate/protect/principal"
)

// ErrBadRemoteAddr reports a request whose RemoteAddr is not an IP address
// (with or without a port), so no visitor can be named.
var ErrBadRemoteAddr = errors.New("clientip: unusable RemoteAddr")

// ErrBadTrusted reports an entry of FAREGATE_TRUSTED_PROXIES that is neither
// a CIDR nor an address.
var ErrBadTrusted = errors.New("clientip: invalid trusted proxy")

// HeaderXFF is the default client IP header; it is the only one read as a
// list of hops, every other header is expected to hold one address.
const HeaderXFF = "X-Forwarded-For"

// ParseTrusted parses FAREGATE_TRUSTED_PROXIES: comma-separated CIDRs or bare
// addresses (bare = /32 or /128), spaces tolerated, empty -> nil. Blank
// entries (a trailing comma) are skipped. The error names each bad entry;
// proxy addresses are configuration, not visitor data, so naming them is safe.
func ParseTrusted(csv string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	var errs []error
	for _, raw := range strings.Split(csv, ",") {
		s := strings.TrimSpace(raw)
		if s == "" {
			continue
		}
		p, ok := parsePrefix(s)
		if !ok {
			errs = append(errs, fmt.Errorf("%w: %q", ErrBadTrusted, s))
			continue
		}
		out = append(out, p)
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return out, nil
}

// parsePrefix reads one trusted entry. Peers are compared in their unmapped
// form, so an IPv4-mapped prefix (::ffff:10.0.0.0/104) is turned into the
// IPv4 prefix it means; otherwise it could never match anything.
func parsePrefix(s string) (netip.Prefix, bool) {
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return netip.Prefix{}, false
		}
		if a := p.Addr(); a.Is4In6() {
			if p.Bits() < 96 {
				return netip.Prefix{}, false
			}
			p = netip.PrefixFrom(a.Unmap(), p.Bits()-96)
		}
		return p.Masked(), true
	}
	a, err := netip.ParseAddr(s)
	// A zone names an interface of one host; it has no place in a proxy list.
	if err != nil || a.Zone() != "" {
		return netip.Prefix{}, false
	}
	a = a.Unmap()
	return netip.PrefixFrom(a, a.BitLen()), true
}

// Resolver names the visitor of a request. It is safe for concurrent use.
type Resolver struct {
	trusted []netip.Prefix
	header  string
	xff     bool
	key     []byte
	macs    *sync.Pool // of keyed HMAC-SHA256 hashes
}

// NewResolver returns a Resolver that believes header only when the TCP peer
// is inside trusted. header is "X-Forwarded-For" (walked right to left,
// skipping trusted entries: the first untrusted valid address wins; if all
// are trusted the left-most wins; a non-address entry met in the walk makes
// the hop that handed it over the visitor) or any single-address header such
// as "CF-Connecting-IP" (one address; invalid or missing -> the TCP peer).
// An empty header means X-Forwarded-For. key is the HMAC key; an empty key is
// replaced by RandomKey(), because keys hashed without a secret could be
// reversed by trying every IPv4 address.
func NewResolver(trusted []netip.Prefix, header string, key []byte) *Resolver {
	if header == "" {
		header = HeaderXFF
	}
	header = textproto.CanonicalMIMEHeaderKey(strings.TrimSpace(header))
	if len(key) == 0 {
		key = RandomKey()
	}
	key = append([]byte(nil), key...)
	return &Resolver{
		trusted: append([]netip.Prefix(nil), trusted...),
		header:  header,
		xff:     header == HeaderXFF,
		key:     key,
		macs:    &sync.Pool{New: func() any { return hmac.New(sha256.New, key) }},
	}
}

// Visitor resolves the request's visitor. IPv4 counts per address, IPv6 per
// /64 prefix (IPv4-mapped IPv6 counts as IPv4; zones are stripped). The error
// is ErrBadRemoteAddr, returned only when RemoteAddr is unusable.
func (r *Resolver) Visitor(req *http.Request) (Visitor, error) {
	peer, ok := parseHost(req.RemoteAddr)
	if !ok {
		return Visitor{}, ErrBadRemoteAddr
	}
	ip := peer
	if r.isTrusted(peer) {
		if r.xff {
			ip = r.walkXFF(req.Header.Values(r.header), peer)
		} else {
			ip = r.single(req.Header.Values(r.header), peer)
		}
	}
	return r.visitor(ip), nil
}

// TrustedPeer reports whether the TCP peer is inside the trusted set, i.e.
// whether headers it sets (such as X-Request-Id) may be believed.
func (r *Resolver) TrustedPeer(req *http.Request) bool {
	peer, ok := parseHost(req.RemoteAddr)
	return ok && r.isTrusted(peer)
}

// TrustedAddr reports whether a is inside the trusted proxies.
func (r *Resolver) TrustedAddr(a netip.Addr) bool { return r.isTrusted(a.Unmap()) }

func (r *Resolver) isTrusted(a netip.Addr) bool {
	for _, p := range r.trusted {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// walkXFF walks the hops from the right, so only entries appended by trusted
// proxies are read; whatever the client wrote itself sits further left and is
// reached only after an untrusted hop has already ended the walk. Several
// header lines form one list in order. The walk scans backwards in place
// because a client controls the length of the header.
func (r *Resolver) walkXFF(values []string, peer netip.Addr) netip.Addr {
	handedOver := peer
	for i := len(values) - 1; i >= 0; i-- {
		rest := values[i]
		for {
			cut := strings.LastIndexByte(rest, ',')
			entry := rest[cut+1:]
			a, ok := parseHost(strings.TrimSpace(entry))
			if !ok {
				// The hop that handed over garbage is the last one we can
				// vouch for; anything further left is unverifiable.
				return handedOver
			}
			if !r.isTrusted(a) {
				return a
			}
			handedOver = a
			if cut < 0 {
				break
			}
			rest = rest[:cut]
		}
	}
	// Every entry was a trusted proxy (or there was none): the left-most
	// hop, or the peer itself, is the best we know.
	return handedOver
}

// single reads a header that names one address. Several header lines or a
// list are ambiguous, so they fall back to the peer like a missing header.
func (r *Resolver) single(values []string, peer netip.Addr) netip.Addr {
	if len(values) != 1 {
		return peer
	}
	a, ok := parseHost(strings.TrimSpace(values[0]))
	if !ok {
		return peer
	}
	return a
}

// parseHost accepts an address, an address with a port, or a bracketed IPv6
// address without a port, as found in RemoteAddr and in X-Forwarded-For
// entries written by proxies that keep the port. The result is unmapped and
// has no zone, so one host always compares and hashes the same way.
func parseHost(s string) (netip.Addr, bool) {
	a, err := netip.ParseAddr(s)
	if err != nil {
		ap, perr := netip.ParseAddrPort(s)
		switch {
		case perr == nil:
			a = ap.Addr()
		case len(s) > 2 && s[0] == '[' && s[len(s)-1] == ']':
			a, err = netip.ParseAddr(s[1 : len(s)-1])
			if err != nil {
				return netip.Addr{}, false
			}
		default:
			return netip.Addr{}, false
		}
	}
	return a.Unmap().WithZone(""), true
}

func (r *Resolver) visitor(ip netip.Addr) Visitor {
	// A keyed HMAC is reset, not rebuilt, per request: Reset returns it to
	// its keyed state, and rebuilding costs four allocations.
	mac := r.macs.Get().(hash.Hash)
	defer r.macs.Put(mac)
	mac.Reset()
	var in [64]byte
	mac.Write(appendCanonical(in[:0], ip))
	var sum [sha256.Size]byte
	return Visitor{key: hex.EncodeToString(mac.Sum(sum[:0])), ip: ip}
}

// appendCanonical appends the text that is hashed: the IPv4 address
// ("192.0.2.7") or the masked IPv6 /64 ("2001:db8:1:2::/64"), since one
// IPv6 subscriber is usually handed a whole /64 and could otherwise rotate
// addresses freely.
func appendCanonical(b []byte, ip netip.Addr) []byte {
	if ip.Is4() {
		return ip.AppendTo(b)
	}
	return netip.PrefixFrom(ip, 64).Masked().AppendTo(b)
}

// Visitor is one resolved visitor. Every way of printing or encoding it shows
// only its HMAC key; the raw address is reachable through RemoteIP alone.
type Visitor struct {
	key string
	ip  netip.Addr
}

// Key returns the visitor's key: hex(HMAC-SHA256(key, ip-or-/64)), 64 hex
// characters. It is the only visitor identity that may be stored or logged.
func (v Visitor) Key() string { return v.key }

// RemoteIP returns the raw client address. It exists ONLY for the remoteip
// field of Turnstile's siteverify call: it must never be logged, stored,
// used as a metric label or sent in a response.
func (v Visitor) RemoteIP() string {
	if !v.ip.IsValid() {
		return ""
	}
	return v.ip.String()
}

// String is the visitor as a principal shows in logs ("v:" and the first
// 12 hex characters of the key): enough to follow one visitor through the
// logs, never the IP.
func (v Visitor) String() string {
	return principal.Principal{Kind: principal.KindVisitor, ID: v.key}.String()
}

// GoString makes %#v print the same short form instead of the fields.
func (v Visitor) GoString() string { return "clientip.Visitor(" + v.String() + ")" }

// Format prints String for every verb (GoString for %#v). Without it, verbs
// that ignore Stringer, such as %d, would print the raw address field.
func (v Visitor) Format(f fmt.State, verb rune) {
	if verb == 'v' && f.Flag('#') {
		fmt.Fprint(f, v.GoString())
		return
	}
	fmt.Fprint(f, v.String())
}

// LogValue makes slog print the same as String, so a Visitor passed as a log
// attribute cannot leak the IP.
func (v Visitor) LogValue() slog.Value { return slog.StringValue(v.String()) }

// MarshalJSON encodes the key only.
func (v Visitor) MarshalJSON() ([]byte, error) {
	// The key is hex, so it needs no escaping.
	return []byte(`"` + v.key + `"`), nil
}

type ctxKey struct{}

// NewContext returns ctx carrying v.
func NewContext(ctx context.Context, v Visitor) context.Context {
	return context.WithValue(ctx, ctxKey{}, v)
}

// FromContext returns the visitor stored by Middleware or NewContext.
func FromContext(ctx context.Context) (Visitor, bool) {
	v, ok := ctx.Value(ctxKey{}).(Visitor)
	return v, ok
}

// Middleware resolves the visitor once and stores it in the request context.
// An unusable RemoteAddr is answered by onError (which receives
// ErrBadRemoteAddr), the integrator's error writer; a nil onError answers
// a bare 500 with no body, since this package writes no error envelope of
// its own.
func (r *Resolver) Middleware(onError func(http.ResponseWriter, *http.Request, error), next http.Handler) http.Handler {
	if onError == nil {
		onError = bareError
	}
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		v, err := r.Visitor(req)
		if err != nil {
			onError(w, req, err)
			return
		}
		next.ServeHTTP(w, req.WithContext(NewContext(req.Context(), v)))
	})
}

func bareError(w http.ResponseWriter, _ *http.Request, _ error) {
	w.WriteHeader(http.StatusInternalServerError)
}

// RandomKey returns 32 random bytes, the HMAC key used when
// FAREGATE_IP_HASH_KEY is empty. Keys then differ per process.
func RandomKey() []byte {
	b := make([]byte, 32)
	// crypto/rand.Read never returns an error since Go 1.24; it aborts the
	// program itself if the system's randomness is unavailable.
	_, _ = rand.Read(b)
	return b
}
