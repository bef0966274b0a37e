package tools

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"faregate/agent/outbound"
)

// august is the fixed clock of the tests: norms are for August.
func august() time.Time { return time.Date(2026, 8, 15, 12, 0, 0, 0, time.UTC) }

// recorder collects a session's warnings and the waits it asked for.
type recorder struct {
	mu     sync.Mutex
	warns  []string
	sleeps []time.Duration
}

func (r *recorder) warn(code, detail string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.warns = append(r.warns, code+":"+detail)
}

func (r *recorder) sleep(ctx context.Context, d time.Duration) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.sleeps = append(r.sleeps, d)
	return ctx.Err()
}

func (r *recorder) waits() []time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]time.Duration(nil), r.sleeps...)
}

// session builds an outbound session on base (nil = the default transport)
// whose sleeps are recorded, not spent.
func session(t *testing.T, base http.RoundTripper) (*outbound.Session, *recorder) {
	t.Helper()
	rec := &recorder{}
	tr := outbound.New(outbound.Options{Version: "test", Base: base, Sleep: rec.sleep})
	return tr.Session(outbound.SessionOptions{Warn: rec.warn}), rec
}

// counted wraps a handler with a request counter.
type counted struct {
	hits atomic.Int64
	h    http.HandlerFunc
}

func (c *counted) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	c.hits.Add(1)
	c.h(w, r)
}

// serve starts a loopback test server counting its requests.
func serve(t *testing.T, h http.HandlerFunc) (*httptest.Server, *counted) {
	t.Helper()
	c := &counted{h: h}
	srv := httptest.NewServer(c)
	t.Cleanup(srv.Close)
	return srv, c
}

// downURL is the address of a server that is down, for as long as the
// test runs: a listener that hangs up on every connection at once. (A
// closed test server's port is free for anything else on the machine to
// take, other test packages included, and a test asking it would then get
// that one's answer.)
func downURL(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			if tc, ok := c.(*net.TCPConn); ok {
				_ = tc.SetLinger(0) // a reset, not an orderly close
			}
			c.Close()
		}
	}()
	return "http://" + ln.Addr().String()
}

// serveOn starts a test server on a chosen loopback address, so a policy
// can allow it while still refusing 127.0.0.1.
func serveOn(t *testing.T, ip string, h http.HandlerFunc) (*httptest.Server, *counted) {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatalf("listen on %s: %v", ip, err)
	}
	c := &counted{h: h}
	srv := httptest.NewUnstartedServer(c)
	srv.Listener.Close()
	srv.Listener = ln
	srv.Start()
	t.Cleanup(srv.Close)
	return srv, c
}

// fakeDNS answers lookups from a table; nothing leaves the process.
type fakeDNS map[string][]netip.Addr

func (f fakeDNS) lookup(_ context.Context, host string) ([]netip.Addr, error) {
	if a, ok := f[host]; ok {
		return a, nil
	}
	return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
}

func addrs(ss ...string) []netip.Addr {
	out := make([]netip.Addr, len(ss))
	for i, s := range ss {
		out[i] = netip.MustParseAddr(s)
	}
	return out
}

// countingBase counts body bytes read through it.
type countingBase struct {
	base http.RoundTripper
	read atomic.Int64
}

func (c *countingBase) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := c.base.RoundTrip(r)
	if err == nil {
		resp.Body = countingBody{resp.Body, &c.read}
	}
	return resp, err
}

type countingBody struct {
	io.ReadCloser
	n *atomic.Int64
}

func (b countingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.n.Add(int64(n))
	return n, err
}

func args(k, v string) string { return fmt.Sprintf(`{%q: %q}`, k, v) }

func taskCtx(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}
