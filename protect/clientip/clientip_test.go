package clientip

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"
)

var testKey = []byte("0123456789abcdef0123456789abcdef")

func mustTrusted(t *testing.T, csv string) []netip.Prefix {
	t.Helper()
	p, err := ParseTrusted(csv)
	if err != nil {
		t.Fatalf("ParseTrusted(%q): %v", csv, err)
	}
	return p
}

func request(remote string, hdr map[string][]string) *http.Request {
	req := httptest.NewRequest(http.MethodGet, "/", nil)
	req.RemoteAddr = remote
	for k, vs := range hdr {
		for _, v := range vs {
			req.Header.Add(k, v)
		}
	}
	return req
}

// keyOf is the key the resolver must produce for an already canonical
// ip-or-prefix, computed through the same HMAC so tests compare identities.
func keyOf(t *testing.T, canon string) string {
	t.Helper()
	r := NewResolver(nil, "", testKey)
	if p, err := netip.ParsePrefix(canon); err == nil {
		return r.visitor(p.Addr()).Key()
	}
	return r.visitor(netip.MustParseAddr(canon)).Key()
}

func TestParseTrusted(t *testing.T) {
	tests := []struct {
		name    string
		in      string
		want    []string
		wantErr []string
	}{
		{name: "empty", in: "", want: nil},
		{name: "spaces only", in: "  ,  ", want: nil},
		{name: "cidrs and bare", in: " 10.0.0.0/8 ,192.0.2.1, 2001:db8::/32,::1 ",
			want: []string{"10.0.0.0/8", "192.0.2.1/32", "2001:db8::/32", "::1/128"}},
		{name: "host bits masked", in: "10.1.2.3/8", want: []string{"10.0.0.0/8"}},
		{name: "mapped becomes ipv4", in: "::ffff:10.0.0.0/104, ::ffff:192.0.2.9",
			want: []string{"10.0.0.0/8", "192.0.2.9/32"}},
		{name: "bad entries all named", in: "10.0.0.0/8, nope, 10.0.0.0/33, fe80::1%eth0",
			wantErr: []string{`"nope"`, `"10.0.0.0/33"`, `"fe80::1%eth0"`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseTrusted(tt.in)
			if tt.wantErr != nil {
				if !errors.Is(err, ErrBadTrusted) {
					t.Fatalf("err = %v, want ErrBadTrusted", err)
				}
				for _, s := range tt.wantErr {
					if !strings.Contains(err.Error(), s) {
						t.Errorf("error %q does not name %s", err, s)
					}
				}
				return
			}
			if err != nil {
				t.Fatalf("unexpected error: %v", err)
			}
			if len(got) != len(tt.want) {
				t.Fatalf("got %v, want %v", got, tt.want)
			}
			for i := range got {
				if got[i].String() != tt.want[i] {
					t.Errorf("[%d] = %s, want %s", i, got[i], tt.want[i])
				}
			}
		})
	}
}

func TestVisitor(t *testing.T) {
	const proxies = "10.0.0.0/8, 192.0.2.10, 2001:db8:ffff::/48"
	xff := func(vs ...string) map[string][]string { return map[string][]string{"X-Forwarded-For": vs} }
	cf := func(vs ...string) map[string][]string { return map[string][]string{"Cf-Connecting-Ip": vs} }
	tests := []struct {
		name    string
		trusted string
		header  string
		remote  string
		hdr     map[string][]string
		want    string // canonical ip-or-prefix of the expected visitor
	}{
		{name: "no proxies ignores xff", remote: "203.0.113.5:4000", hdr: xff("198.51.100.1"), want: "203.0.113.5"},
		{name: "untrusted peer spoofs xff", trusted: proxies, remote: "203.0.113.5:4000",
			hdr: xff("198.51.100.1"), want: "203.0.113.5"},
		{name: "untrusted peer spoofs cf header", trusted: proxies, header: "CF-Connecting-IP",
			remote: "203.0.113.5:4000", hdr: cf("198.51.100.1"), want: "203.0.113.5"},
		{name: "trusted proxy xff", trusted: proxies, remote: "10.1.1.1:80", hdr: xff("198.51.100.1"), want: "198.51.100.1"},
		{name: "trusted proxy cf header", trusted: proxies, header: "CF-Connecting-IP",
			remote: "10.1.1.1:80", hdr: cf(" 198.51.100.1 "), want: "198.51.100.1"},
		{name: "cf header missing", trusted: proxies, header: "CF-Connecting-IP", remote: "10.1.1.1:80", want: "10.1.1.1"},
		{name: "cf header invalid", trusted: proxies, header: "CF-Connecting-IP", remote: "10.1.1.1:80",
			hdr: cf("unknown"), want: "10.1.1.1"},
		{name: "cf header list", trusted: proxies, header: "CF-Connecting-IP", remote: "10.1.1.1:80",
			hdr: cf("198.51.100.1, 198.51.100.2"), want: "10.1.1.1"},
		{name: "cf header twice", trusted: proxies, header: "CF-Connecting-IP", remote: "10.1.1.1:80",
			hdr: cf("198.51.100.1", "198.51.100.2"), want: "10.1.1.1"},
		{name: "cf configured, xff ignored", trusted: proxies, header: "CF-Connecting-IP", remote: "10.1.1.1:80",
			hdr: xff("198.51.100.1"), want: "10.1.1.1"},
		{name: "trusted proxy without xff", trusted: proxies, remote: "10.1.1.1:80", want: "10.1.1.1"},
		{name: "multi-hop skips trusted", trusted: proxies, remote: "10.1.1.1:80",
			hdr: xff("6.6.6.6, 198.51.100.1, 192.0.2.10, 10.9.9.9"), want: "198.51.100.1"},
		{name: "multi-hop over several header lines", trusted: proxies, remote: "10.1.1.1:80",
			hdr: xff("6.6.6.6, 198.51.100.1", "192.0.2.10", "10.9.9.9"), want: "198.51.100.1"},
		{name: "all trusted takes left-most", trusted: proxies, remote: "10.1.1.1:80",
			hdr: xff("10.3.3.3, 192.0.2.10, 10.2.2.2"), want: "10.3.3.3"},
		{name: "garbage mid-walk gives handing hop", trusted: proxies, remote: "10.1.1.1:80",
			hdr: xff("198.51.100.1, nonsense, 10.2.2.2, 192.0.2.10"), want: "10.2.2.2"},
		{name: "garbage right-most gives peer", trusted: proxies, remote: "10.1.1.1:80",
			hdr: xff("198.51.100.1, unknown"), want: "10.1.1.1"},
		{name: "empty xff gives peer", trusted: proxies, remote: "10.1.1.1:80", hdr: xff(""), want: "10.1.1.1"},
		{name: "xff entries with ports", trusted: proxies, remote: "10.1.1.1:80",
			hdr: xff("[2001:db8:1:2::9]:443, 10.2.2.2:8080"), want: "2001:db8:1:2::/64"},
		{name: "xff ipv6 trusted hop", trusted: proxies, remote: "[2001:db8:ffff:1::1]:443",
			hdr: xff("198.51.100.7, 2001:db8:ffff:2::2"), want: "198.51.100.7"},
		{name: "xff mapped entry", trusted: proxies, remote: "10.1.1.1:80",
			hdr: xff("::ffff:198.51.100.3"), want: "198.51.100.3"},
		{name: "ipv6 peer per /64", remote: "[2001:db8:1:2:aaaa:bbbb:cccc:dddd]:5", want: "2001:db8:1:2::/64"},
		{name: "ipv6 zone stripped", remote: "[fe80::1%eth0]:5", want: "fe80::/64"},
		{name: "ipv4-mapped peer", remote: "[::ffff:203.0.113.5]:4000", want: "203.0.113.5"},
		{name: "mapped peer is trusted", trusted: proxies, remote: "[::ffff:10.1.1.1]:80",
			hdr: xff("198.51.100.1"), want: "198.51.100.1"},
		{name: "bare ipv4 remote", remote: "203.0.113.5", want: "203.0.113.5"},
		{name: "bare ipv6 remote", remote: "2001:db8::1", want: "2001:db8::/64"},
		{name: "bracketed ipv6 remote without port", remote: "[2001:db8::1]", want: "2001:db8::/64"},
		{name: "lower-case header name", trusted: proxies, header: "x-forwarded-for", remote: "10.1.1.1:80",
			hdr: xff("198.51.100.1"), want: "198.51.100.1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var trusted []netip.Prefix
			if tt.trusted != "" {
				trusted = mustTrusted(t, tt.trusted)
			}
			r := NewResolver(trusted, tt.header, testKey)
			v, err := r.Visitor(request(tt.remote, tt.hdr))
			if err != nil {
				t.Fatalf("Visitor: %v", err)
			}
			if want := keyOf(t, tt.want); v.Key() != want {
				t.Errorf("visitor is %s (ip %s), want the visitor of %s", v, v.RemoteIP(), tt.want)
			}
		})
	}
}

func TestVisitorBadRemoteAddr(t *testing.T) {
	r := NewResolver(nil, "", testKey)
	for _, remote := range []string{"", "@", "pipe", "example.com:80", "[]", "1.2.3.4:port"} {
		t.Run(remote, func(t *testing.T) {
			_, err := r.Visitor(request(remote, nil))
			if !errors.Is(err, ErrBadRemoteAddr) {
				t.Fatalf("err = %v, want ErrBadRemoteAddr", err)
			}
		})
	}
}

func TestIPv6Prefix(t *testing.T) {
	r := NewResolver(nil, "", testKey)
	base := netip.MustParseAddr("2001:db8:aa:bb::")
	first := ""
	for i := range 64 {
		// Spread the 64 addresses over the whole interface identifier.
		b := base.As16()
		b[8], b[15] = byte(i*4), byte(i*7+1)
		v, err := r.Visitor(request(netip.AddrPortFrom(netip.AddrFrom16(b), 443).String(), nil))
		if err != nil {
			t.Fatal(err)
		}
		if first == "" {
			first = v.Key()
		}
		if v.Key() != first {
			t.Fatalf("address %d of one /64 is another visitor", i)
		}
	}
	other, err := r.Visitor(request("[2001:db8:aa:bc::1]:443", nil))
	if err != nil {
		t.Fatal(err)
	}
	if other.Key() == first {
		t.Fatal("a neighbouring /64 is the same visitor")
	}
}

func TestKey(t *testing.T) {
	req := request("203.0.113.5:1", nil)
	a, _ := NewResolver(nil, "", testKey).Visitor(req)
	b, _ := NewResolver(nil, "", []byte("another key")).Visitor(req)
	c, _ := NewResolver(nil, "", nil).Visitor(req)
	d, _ := NewResolver(nil, "", nil).Visitor(req)
	tests := []struct {
		name string
		x, y Visitor
	}{
		{name: "different hash key", x: a, y: b},
		{name: "empty key is random per resolver", x: c, y: d},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for _, v := range []Visitor{tt.x, tt.y} {
				if len(v.Key()) != 64 || strings.Trim(v.Key(), "0123456789abcdef") != "" {
					t.Fatalf("key %q is not 64 hex chars", v.Key())
				}
			}
			if tt.x.Key() == tt.y.Key() {
				t.Fatal("keys are equal")
			}
		})
	}
	if again, _ := NewResolver(nil, "", testKey).Visitor(req); again.Key() != a.Key() {
		t.Error("same hash key gave a different visitor key")
	}
	if bytes.Equal(RandomKey(), RandomKey()) || len(RandomKey()) != 32 {
		t.Error("RandomKey is not 32 fresh bytes")
	}
}

func TestNoLeak(t *testing.T) {
	for _, remote := range []string{"203.0.113.77:9", "[2001:db8:5:6::77]:9"} {
		v, err := NewResolver(nil, "", testKey).Visitor(request(remote, nil))
		if err != nil {
			t.Fatal(err)
		}
		ip := v.RemoteIP()
		if ip == "" || !strings.Contains(remote, ip) {
			t.Fatalf("RemoteIP = %q, want the raw address of %q", ip, remote)
		}
		var logBuf, textBuf bytes.Buffer
		slog.New(slog.NewJSONHandler(&logBuf, nil)).Info("x", "visitor", v, "ptr", &v)
		slog.New(slog.NewTextHandler(&textBuf, nil)).Info("x", "visitor", v)
		js, err := json.Marshal(map[string]any{"v": v})
		if err != nil {
			t.Fatal(err)
		}
		outputs := map[string]string{
			"Sprint": fmt.Sprint(v), "%v": fmt.Sprintf("%v", v), "%+v": fmt.Sprintf("%+v", v),
			"%#v": fmt.Sprintf("%#v", v), "%s": fmt.Sprintf("%s", v), "%d": fmt.Sprintf("%d", v),
			"%x": fmt.Sprintf("%x", v), "pointer %+v": fmt.Sprintf("%+v", &v),
			"in struct %+v": fmt.Sprintf("%+v", struct{ V Visitor }{v}),
			"in struct %#v": fmt.Sprintf("%#v", struct{ V Visitor }{v}),
			"slog json":     logBuf.String(), "slog text": textBuf.String(), "json": string(js),
		}
		short := v.Key()[:12]
		// Every fmt verb must print exactly the short form: a verb that
		// fell through to the fields would print the address in some
		// encoding a substring check could miss.
		for _, verb := range []string{"%v", "%+v", "%s", "%d", "%x", "%q", "%10v"} {
			if got := fmt.Sprintf(verb, v); strings.TrimSpace(got) != "v:"+short {
				t.Errorf("Sprintf(%s) = %q, want v:%s", verb, got, short)
			}
		}
		if got := fmt.Sprintf("%#v", v); got != "clientip.Visitor(v:"+short+")" {
			t.Errorf("%%#v = %q", got)
		}
		for name, out := range outputs {
			t.Run(remote+" "+name, func(t *testing.T) {
				if strings.Contains(out, ip) || strings.Contains(out, strings.Split(ip, "::")[0]+":") {
					t.Fatalf("output leaks the IP: %s", out)
				}
				if !strings.Contains(out, short) {
					t.Fatalf("output %q lacks the key prefix %s", out, short)
				}
			})
		}
		if got := string(js); got != `{"v":"`+v.Key()+`"}` {
			t.Errorf("json = %s", got)
		}
		if v.String() != "v:"+short {
			t.Errorf("String = %q", v.String())
		}
	}
}

func TestTrustedPeer(t *testing.T) {
	r := NewResolver(mustTrusted(t, "10.0.0.0/8"), "", testKey)
	tests := []struct {
		remote string
		want   bool
	}{
		{"10.0.0.1:80", true}, {"[::ffff:10.0.0.1]:80", true}, {"11.0.0.1:80", false}, {"garbage", false},
	}
	for _, tt := range tests {
		t.Run(tt.remote, func(t *testing.T) {
			if got := r.TrustedPeer(request(tt.remote, nil)); got != tt.want {
				t.Fatalf("TrustedPeer = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestMiddleware(t *testing.T) {
	r := NewResolver(nil, "", testKey)
	want, _ := r.Visitor(request("203.0.113.5:1", nil))
	var seen Visitor
	var seenOK bool
	next := http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		seen, seenOK = FromContext(req.Context())
		w.WriteHeader(http.StatusNoContent)
	})
	var gotErr error
	onError := func(w http.ResponseWriter, _ *http.Request, err error) {
		gotErr = err
		w.WriteHeader(http.StatusTeapot)
	}
	tests := []struct {
		name     string
		remote   string
		onError  func(http.ResponseWriter, *http.Request, error)
		wantCode int
		wantNext bool
	}{
		{name: "resolves", remote: "203.0.113.5:1", onError: onError, wantCode: http.StatusNoContent, wantNext: true},
		{name: "bad remote", remote: "@", onError: onError, wantCode: http.StatusTeapot},
		{name: "bad remote default", remote: "@", wantCode: http.StatusInternalServerError},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			seen, seenOK, gotErr = Visitor{}, false, nil
			rec := httptest.NewRecorder()
			r.Middleware(tt.onError, next).ServeHTTP(rec, request(tt.remote, nil))
			if rec.Code != tt.wantCode {
				t.Fatalf("status %d, want %d", rec.Code, tt.wantCode)
			}
			if seenOK != tt.wantNext {
				t.Fatalf("next saw a visitor: %v, want %v", seenOK, tt.wantNext)
			}
			if tt.wantNext && seen.Key() != want.Key() {
				t.Errorf("context visitor %s, want %s", seen, want)
			}
			if tt.onError != nil && !tt.wantNext && !errors.Is(gotErr, ErrBadRemoteAddr) {
				t.Errorf("onError got %v", gotErr)
			}
			// The envelope is the integrator's to write (onError).
			if tt.onError == nil && rec.Body.Len() != 0 {
				t.Errorf("default body %q, want none", rec.Body.String())
			}
		})
	}
	if _, ok := FromContext(context.Background()); ok {
		t.Error("empty context has a visitor")
	}
	if v, ok := FromContext(NewContext(context.Background(), want)); !ok || v.Key() != want.Key() {
		t.Error("NewContext/FromContext round trip failed")
	}
}

func BenchmarkVisitorXFF(b *testing.B) {
	trusted, _ := ParseTrusted("10.0.0.0/8, 192.0.2.0/24")
	r := NewResolver(trusted, "", testKey)
	req := request("10.1.1.1:80", map[string][]string{"X-Forwarded-For": {"198.51.100.1, 192.0.2.4, 10.2.2.2"}})
	b.ReportAllocs()
	for b.Loop() {
		if _, err := r.Visitor(req); err != nil {
			b.Fatal(err)
		}
	}
}
