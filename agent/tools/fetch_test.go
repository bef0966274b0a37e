package tools

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"faregate/agent/outbound"
	"faregate/protect/codes"
)

// allowedIP is where the "public" test server listens: the policy of the
// happy-path tests allows exactly this address, so 127.0.0.1 stays refused.
const allowedIP = "127.0.0.2"

func allowTestServer(a netip.Addr) bool {
	return a == netip.MustParseAddr(allowedIP) || IsPublic(a)
}

// fetchTool builds fetch_page the way the lead wires it: an outbound
// session whose base is SafeTransport.
func fetchTool(t *testing.T, p Policy, wrap func(http.RoundTripper) http.RoundTripper) (Tool, *outbound.Session) {
	t.Helper()
	var base http.RoundTripper = SafeTransport(p)
	if wrap != nil {
		base = wrap(base)
	}
	sess, _ := session(t, base)
	return NewFetchPage(sess.Client()), sess
}

const page = `<!doctype html><html><head><title>Lisbon  in
  a day</title><style>body{color:red}</style><script>var secret = "do not show";</script></head>
<body><nav><a href="/">Home</a> | <a href="/menu">Menu nav item</a></nav>
<h1>Lisbon in a day</h1>
<p>Start at   <b>Praça do Comércio</b>,
   then climb to the castle.</p>
<ul><li>Tram 28</li><li>Pastéis de Belém</li></ul>
<noscript>enable JS</noscript><script>alert("x")</script>
</body></html>`

func TestFetchPageExtractsText(t *testing.T) {
	srv, _ := serveOn(t, allowedIP, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		io.WriteString(w, page)
	})
	tool, _ := fetchTool(t, Policy{Allow: allowTestServer}, nil)
	obs := tool.Call(context.Background(), args("url", srv.URL+"/day#top"))
	if obs.Failed || obs.Warning != "" {
		t.Fatalf("%+v", obs)
	}
	want := "Page " + srv.URL + "/day — Lisbon in a day\n\nLisbon in a day\nStart at Praça do Comércio, then climb to the castle.\nTram 28\nPastéis de Belém"
	if obs.Text != want {
		t.Fatalf("text:\n%q\nwant:\n%q", obs.Text, want)
	}
}

func TestFetchPageContentTypes(t *testing.T) {
	tests := []struct {
		name, ctype, body string
		wantFailed        bool
		want              string
	}{
		{"plain text", "text/plain", "hello\n\n\n   world  ", false, "hello\nworld"},
		{"json", "application/json", `{"a": 1}`, false, `{"a": 1}`},
		{"latin-1", "text/plain; charset=iso-8859-1", "caf\xe9", false, "café"},
		{"sniffed html", "", "<html><body><p>sniffed</p></body></html>", false, "sniffed"},
		{"binary", "image/png", "\x89PNG\r\n", true, "not a text or HTML page"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			srv, _ := serveOn(t, allowedIP, func(w http.ResponseWriter, r *http.Request) {
				w.Header()["Content-Type"] = []string{tc.ctype}
				io.WriteString(w, tc.body)
			})
			tool, _ := fetchTool(t, Policy{Allow: allowTestServer}, nil)
			obs := tool.Call(context.Background(), args("url", srv.URL))
			if obs.Failed != tc.wantFailed || (tc.wantFailed && obs.Warning != codes.FetchFailed) {
				t.Fatalf("%+v", obs)
			}
			if !strings.Contains(obs.Text, tc.want) {
				t.Fatalf("text %q lacks %q", obs.Text, tc.want)
			}
		})
	}
}

func TestFetchPageReadsAtMostOneMiB(t *testing.T) {
	const served = 3 << 20
	srv, _ := serveOn(t, allowedIP, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		line := []byte(strings.Repeat("word ", 1000) + "\n")
		for sent := 0; sent < served; sent += len(line) {
			if _, err := w.Write(line); err != nil {
				return
			}
		}
	})
	var counter *countingBase
	tool, _ := fetchTool(t, Policy{Allow: allowTestServer}, func(b http.RoundTripper) http.RoundTripper {
		counter = &countingBase{base: b}
		return counter
	})
	obs := tool.Call(context.Background(), args("url", srv.URL+"/big"))
	if obs.Failed {
		t.Fatalf("%+v", obs)
	}
	if n := counter.read.Load(); n > MaxPageBytes {
		t.Fatalf("read %d bytes of a %d-byte page, limit %d", n, served, MaxPageBytes)
	}
	if !strings.HasSuffix(obs.Text, "[page truncated]") || len([]rune(obs.Text)) > MaxPageText+200 {
		t.Fatalf("observation of %d runes, tail %q", len([]rune(obs.Text)), obs.Text[len(obs.Text)-40:])
	}
}

func TestFetchPageRefusesNonPublic(t *testing.T) {
	// A server on 127.0.0.1 that must never see a request.
	internal, internalHits := serve(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "internal secret") })
	port := internal.Listener.Addr().(interface{ AddrPort() netip.AddrPort }).AddrPort().Port()
	public, _ := serveOn(t, allowedIP, func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, r.URL.Query().Get("to"), http.StatusFound)
	})
	dns := fakeDNS{
		"evil.test":      addrs("10.0.0.1"),
		"rebind.test":    addrs("127.0.0.1"),
		"mixed.test":     addrs("93.184.215.14", "192.168.1.1"),
		"metadata.test":  addrs("169.254.169.254"),
		"mapped.test":    addrs("::ffff:10.0.0.1"),
		"nat64.test":     addrs("64:ff9b::a9fe:a9fe"), // 169.254.169.254 through NAT64
		"localhost.test": addrs("::1"),
	}
	tests := []struct {
		name   string
		url    string
		policy Policy
	}{
		{"loopback literal", internal.URL, Policy{LookupIP: dns.lookup}},
		{"private literal", "http://10.0.0.1/", Policy{LookupIP: dns.lookup}},
		{"metadata literal", "http://169.254.169.254/latest/meta-data/", Policy{LookupIP: dns.lookup}},
		{"IPv6 loopback literal", fmt.Sprintf("http://[::1]:%d/", port), Policy{LookupIP: dns.lookup}},
		{"IPv4-mapped literal", "http://[::ffff:127.0.0.1]/", Policy{LookupIP: dns.lookup}},
		{"name resolving to private", "http://evil.test/", Policy{LookupIP: dns.lookup}},
		{"name resolving to loopback", fmt.Sprintf("http://rebind.test:%d/", port), Policy{LookupIP: dns.lookup}},
		{"name with one private address among public ones", "https://mixed.test/", Policy{LookupIP: dns.lookup}},
		{"name resolving to metadata", "http://metadata.test/", Policy{LookupIP: dns.lookup}},
		{"name resolving to mapped private", "http://mapped.test/", Policy{LookupIP: dns.lookup}},
		{"name resolving to NAT64 metadata", "http://nat64.test/", Policy{LookupIP: dns.lookup}},
		{"name resolving to IPv6 loopback", "http://localhost.test/", Policy{LookupIP: dns.lookup}},
		{"redirect to loopback", public.URL + "/?to=" + internal.URL, Policy{Allow: allowTestServer, LookupIP: dns.lookup}},
		{"redirect to private name", public.URL + "/?to=http://evil.test/", Policy{Allow: allowTestServer, LookupIP: dns.lookup}},
		{"allowed server refused by the default policy", public.URL, Policy{LookupIP: dns.lookup}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tool, sess := fetchTool(t, tc.policy, nil)
			// A short deadline: if the refusal ever turned into a real
			// connect attempt to 10.0.0.1, the test fails fast instead of
			// hanging on an unroutable address.
			start := time.Now()
			obs := tool.Call(taskCtx(t, 3*time.Second), args("url", tc.url))
			if !obs.Failed || obs.Warning != codes.FetchFailed || !strings.Contains(obs.Text, "not on the public internet") {
				t.Fatalf("observation %+v", obs)
			}
			if strings.Contains(obs.Text, "internal secret") {
				t.Fatal("internal content leaked")
			}
			if d := time.Since(start); d > time.Second {
				t.Errorf("refusal took %v: something was dialled", d)
			}
			if st := sess.Stats(); st.Retries != 0 {
				t.Errorf("a refused address was retried: %+v", st)
			}
		})
	}
	if h := internalHits.hits.Load(); h != 0 {
		t.Fatalf("the internal server saw %d requests", h)
	}
}

func TestFetchPageRedirectLimit(t *testing.T) {
	srv, hits := serveOn(t, allowedIP, func(w http.ResponseWriter, r *http.Request) {
		var n int
		fmt.Sscanf(r.URL.Path, "/hop%d", &n)
		if r.URL.Query().Get("stop") == fmt.Sprint(n) {
			io.WriteString(w, "arrived")
			return
		}
		http.Redirect(w, r, fmt.Sprintf("/hop%d?%s", n+1, r.URL.RawQuery), http.StatusFound)
	})
	tests := []struct {
		name       string
		stop       int
		wantFailed bool
		wantHits   int64
	}{
		{"three redirects followed", 3, false, 4},
		{"fourth redirect refused", 10, true, 4},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			before := hits.hits.Load()
			tool, _ := fetchTool(t, Policy{Allow: allowTestServer}, nil)
			obs := tool.Call(context.Background(), args("url", fmt.Sprintf("%s/hop0?stop=%d", srv.URL, tc.stop)))
			if obs.Failed != tc.wantFailed {
				t.Fatalf("%+v", obs)
			}
			if tc.wantFailed && (obs.Warning != codes.FetchFailed || !strings.Contains(obs.Text, "redirects more than 3 times")) {
				t.Fatalf("%+v", obs)
			}
			if !tc.wantFailed && !strings.Contains(obs.Text, "arrived") {
				t.Fatalf("%+v", obs)
			}
			if h := hits.hits.Load() - before; h != tc.wantHits {
				t.Fatalf("server saw %d requests, want %d", h, tc.wantHits)
			}
		})
	}
}

func TestFetchPageFailures(t *testing.T) {
	srv, _ := serveOn(t, allowedIP, func(w http.ResponseWriter, r *http.Request) { http.NotFound(w, r) })
	tool, _ := fetchTool(t, Policy{Allow: allowTestServer, LookupIP: fakeDNS{}.lookup}, nil)
	tests := []struct {
		name, url, want string
		warn            bool
	}{
		{"404", srv.URL + "/missing", "the server answered 404", true},
		{"unknown host", "http://nowhere.test/", "the host name does not resolve", true},
		{"ftp scheme", "ftp://example.org/file", "absolute http or https URL", false},
		{"relative", "/just/a/path", "absolute http or https URL", false},
		{"credentials", "https://user:pass@example.org/", "does not send credentials", false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			obs := tool.Call(context.Background(), args("url", tc.url))
			if !obs.Failed || (obs.Warning == codes.FetchFailed) != tc.warn || !strings.Contains(obs.Text, tc.want) {
				t.Fatalf("%+v", obs)
			}
		})
	}
}

func TestFetchPageThirtyEightConcurrentCalls(t *testing.T) {
	release := make(chan struct{})
	srv, hits := serveOn(t, allowedIP, func(w http.ResponseWriter, r *http.Request) {
		<-release
		io.WriteString(w, "the same document")
	})
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})
	tool, sess := fetchTool(t, Policy{Allow: allowTestServer}, nil)
	var wg sync.WaitGroup
	obs := make([]Observation, 38)
	for i := range obs {
		wg.Go(func() { obs[i] = tool.Call(context.Background(), args("url", srv.URL+"/doc")) })
	}
	close(release)
	wg.Wait()
	for i, o := range obs {
		if o.Failed || !strings.Contains(o.Text, "the same document") {
			t.Fatalf("call %d: %+v", i, o)
		}
	}
	if h := hits.hits.Load(); h != 1 {
		t.Fatalf("server saw %d requests, want 1 (stats %+v)", h, sess.Stats())
	}
}

func TestIsPublic(t *testing.T) {
	tests := []struct {
		addr string
		want bool
	}{
		{"8.8.8.8", true},
		{"93.184.215.14", true},
		{"2606:4700:4700::1111", true},
		{"64:ff9b::808:808", true}, // NAT64 of 8.8.8.8
		{"::ffff:8.8.8.8", true},
		{"127.0.0.1", false},
		{"127.255.255.254", false},
		{"10.0.0.1", false},
		{"172.16.0.1", false},
		{"172.31.255.255", false},
		{"192.168.1.1", false},
		{"169.254.169.254", false},
		{"100.64.0.1", false},
		{"100.127.255.255", false},
		{"0.0.0.0", false},
		{"0.1.2.3", false},
		{"192.0.0.170", false},
		{"198.18.0.1", false},
		{"198.19.255.255", false},
		{"224.0.0.1", false},
		{"239.255.255.250", false},
		{"240.0.0.1", false},
		{"255.255.255.255", false},
		{"::", false},
		{"::1", false},
		{"::ffff:127.0.0.1", false},
		{"::ffff:10.0.0.1", false},
		{"::ffff:169.254.169.254", false},
		{"64:ff9b::7f00:1", false},    // NAT64 of 127.0.0.1
		{"64:ff9b::a00:1", false},     // NAT64 of 10.0.0.1
		{"64:ff9b::a9fe:a9fe", false}, // NAT64 of 169.254.169.254
		{"64:ff9b:1::a00:1", false},
		{"fc00::1", false},
		{"fd00:ec2::254", false},
		{"fe80::1", false},
		{"fe80::1%eth0", false},
		{"ff02::1", false},
		{"2001:db8::1", false},
		{"2001::1", false},
		{"2002:a00:1::1", false},
		{"::127.0.0.1", false},
		{"100::1", false},
	}
	for _, tc := range tests {
		t.Run(tc.addr, func(t *testing.T) {
			if got := IsPublic(netip.MustParseAddr(tc.addr)); got != tc.want {
				t.Fatalf("IsPublic(%s) = %v, want %v", tc.addr, got, tc.want)
			}
		})
	}
	if IsPublic(netip.Addr{}) {
		t.Fatal("the zero Addr is public")
	}
}

func TestControlChecksDialledAddress(t *testing.T) {
	// The dialer's Control hook is the last check before connect; it must
	// refuse on its own, whatever resolution came before.
	g := &guard{}
	tests := []struct {
		addr string
		ok   bool
	}{
		{"93.184.215.14:443", true},
		{"[2606:4700:4700::1111]:443", true},
		{"127.0.0.1:80", false},
		{"[::1]:80", false},
		{"[::ffff:10.0.0.1]:80", false},
		{"169.254.169.254:80", false},
		{"not-an-address", false},
	}
	for _, tc := range tests {
		t.Run(tc.addr, func(t *testing.T) {
			err := g.control(context.Background(), "tcp", tc.addr, nil)
			if (err == nil) != tc.ok {
				t.Fatalf("control(%s) = %v", tc.addr, err)
			}
			if err != nil && (!errors.Is(err, ErrForbiddenAddress) || !errors.Is(err, outbound.ErrPermanent)) {
				t.Fatalf("error %v is not ErrForbiddenAddress + ErrPermanent", err)
			}
		})
	}
}
