package connlimit

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"faregate/protect/kit/testkit/clocktest"
)

// serve starts an HTTP server on a wrapped listener whose handler answers
// 503 on refused connections and otherwise blocks until release is closed,
// so the test controls how many connections are held.
func serve(t *testing.T, o Options) (*Listener, string, chan struct{}) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := Wrap(ln, o)
	release := make(chan struct{})
	srv := &http.Server{
		ConnContext: l.ConnContext,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if Refused(r.Context()) {
				w.Header().Set("Connection", "close")
				w.WriteHeader(http.StatusServiceUnavailable)
				return
			}
			w.WriteHeader(http.StatusOK)
			w.(http.Flusher).Flush()
			<-release
		}),
	}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
		_ = srv.Close()
	})
	return l, ln.Addr().String(), release
}

// request sends one GET on a new connection and returns the status line's
// code; the connection stays open (held) until the test ends.
func request(t *testing.T, addr string) int {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	if _, err := fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode
}

func TestProcessLimit(t *testing.T) {
	reg := prometheus.NewRegistry()
	l, addr, _ := serve(t, Options{Max: 3, Registerer: reg})
	for i := 0; i < 3; i++ {
		if got := request(t, addr); got != http.StatusOK {
			t.Fatalf("connection %d: %d, want 200", i, got)
		}
	}
	if got := request(t, addr); got != http.StatusServiceUnavailable {
		t.Fatalf("fourth connection: %d, want 503", got)
	}
	if got := testutil.ToFloat64(l.refused.WithLabelValues("process")); got != 1 {
		t.Fatalf("refused{process} = %v, want 1", got)
	}
	if l.Open() < 3 {
		t.Fatalf("open = %d, want at least 3", l.Open())
	}
}

func TestReleaseOnClose(t *testing.T) {
	l, addr, _ := serve(t, Options{Max: 1})
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	// The server's Accept and its reading of the close are events outside
	// the test: poll for them.
	clocktest.Poll(5*time.Second, func() bool { return l.Open() == 1 })
	_ = c.Close()
	clocktest.Poll(5*time.Second, func() bool { return l.Open() == 0 })
	if l.Open() != 0 {
		t.Fatalf("open = %d after the client closed, want 0", l.Open())
	}
	if got := request(t, addr); got != http.StatusOK {
		t.Fatalf("after release: %d, want 200", got)
	}
}

func TestPerPeer(t *testing.T) {
	exempt := func(a netip.Addr) bool { return false }
	_, addr, _ := serve(t, Options{PerPeer: 2, Exempt: exempt})
	for i := 0; i < 2; i++ {
		if got := request(t, addr); got != http.StatusOK {
			t.Fatalf("connection %d: %d", i, got)
		}
	}
	if got := request(t, addr); got != http.StatusServiceUnavailable {
		t.Fatalf("third connection from one peer: %d, want 503", got)
	}

	// An exempt peer (a trusted proxy) is not limited per peer.
	_, addr2, _ := serve(t, Options{PerPeer: 1, Exempt: func(netip.Addr) bool { return true }})
	for i := 0; i < 3; i++ {
		if got := request(t, addr2); got != http.StatusOK {
			t.Fatalf("exempt connection %d: %d", i, got)
		}
	}
}

func TestPeerOf(t *testing.T) {
	cases := map[string]string{
		"127.0.0.1:5":                    "127.0.0.1",
		"[::ffff:10.0.0.1]:80":           "10.0.0.1",
		"[2001:db8:1:2:3:4:5:6]:443":     "2001:db8:1:2::",
		"[2001:db8:1:2:ffff::1%eth0]:44": "2001:db8:1:2::",
	}
	for in, want := range cases {
		got := peerOf(fakeConn{addr: in})
		if got.String() != want {
			t.Errorf("peerOf(%s) = %s, want %s", in, got, want)
		}
	}
}

type fakeConn struct {
	net.Conn
	addr string
}

type strAddr string

func (s strAddr) Network() string { return "tcp" }
func (s strAddr) String() string  { return string(s) }

func (f fakeConn) RemoteAddr() net.Addr { return strAddr(f.addr) }

func TestRefusedContext(t *testing.T) {
	if Refused(context.Background()) {
		t.Fatal("a plain context is not refused")
	}
}
