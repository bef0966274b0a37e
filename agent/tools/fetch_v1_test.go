package tools

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
)

// TestFetchForAgent: /v1/tools/fetch's fetch: a page's readable text with
// its status and type; max_bytes truncates and says so; an answer that is
// not text keeps its status and type with no text; the same request is
// answered once per session; anything not public is ErrFetchRefused.
func TestFetchForAgent(t *testing.T) {
	srv, hits := serveOn(t, allowedIP, func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/page":
			w.Header().Set("Content-Type", "text/html; charset=utf-8")
			io.WriteString(w, page)
		case "/big":
			w.Header().Set("Content-Type", "text/plain")
			io.WriteString(w, strings.Repeat("a", 5000))
		case "/png":
			w.Header().Set("Content-Type", "image/png")
			w.WriteHeader(http.StatusNotFound)
			io.WriteString(w, "\x89PNG")
		}
	})
	sess, _ := session(t, SafeTransport(Policy{Allow: allowTestServer}))
	c := sess.Client()
	ctx := context.Background()

	got, err := Fetch(ctx, c, srv.URL+"/page#frag", 0)
	if err != nil {
		t.Fatal(err)
	}
	if got.Status != 200 || got.ContentType != "text/html" || got.Truncated ||
		got.Text != "Lisbon in a day\nStart at Praça do Comércio, then climb to the castle.\nTram 28\nPastéis de Belém" {
		t.Fatalf("page: %+v", got)
	}
	if _, err := Fetch(ctx, c, srv.URL+"/page", 0); err != nil {
		t.Fatal(err)
	}
	if n := hits.hits.Load(); n != 1 {
		t.Fatalf("the same request reached the server %d times, want once per session", n)
	}
	big, err := Fetch(ctx, c, srv.URL+"/big", 100)
	if err != nil || !big.Truncated || len(big.Text) != 100 {
		t.Fatalf("max_bytes 100: %+v %v", big, err)
	}
	png, err := Fetch(ctx, c, srv.URL+"/png", 0)
	if err != nil || png.Status != 404 || png.ContentType != "image/png" || png.Text != "" {
		t.Fatalf("binary: %+v %v", png, err)
	}

	strict, _ := session(t, SafeTransport(Policy{}))
	for _, u := range []string{srv.URL + "/page", "http://127.0.0.1:1/", "http://[::1]/", "http://10.0.0.1/",
		"ftp://example.org/", "https://user:pw@example.org/", "/relative", ""} {
		if _, err := Fetch(ctx, strict.Client(), u, 0); !errors.Is(err, ErrFetchRefused) {
			t.Fatalf("%q: %v, want ErrFetchRefused", u, err)
		}
	}
}

// TestCheckFetchURL: what Fetch refuses without the network, and what it
// leaves to the dial (a name, judged by its addresses).
func TestCheckFetchURL(t *testing.T) {
	for _, tc := range []struct {
		url    string
		refuse bool
	}{
		{"https://example.org/page", false},
		{"http://example.org:8080/a?b#c", false},
		{"http://localhost/", false}, // a name: the dial judges it
		{"http://93.184.215.14/", false},
		{"http://[2606:4700::6810:84e5]/", false},
		{"http://127.0.0.1/", true},
		{"http://[::1]:8080/", true},
		{"http://[::ffff:127.0.0.1]/", true},
		{"http://169.254.169.254/latest", true},
		{"http://10.1.2.3/", true},
		{"http://[fe80::1%25eth0]/", true},
		{"ftp://example.org/", true},
		{"file:///etc/passwd", true},
		{"javascript:alert(1)", true},
		{"https:///x", true},
		{"//example.org/", true},
		{"http://user:pw@example.org/", true},
		{"http://example.org/" + strings.Repeat("a", 2048), true},
		{"http://exa mple.org/", true},
		// Loopback and private literals in every IPv4 form a resolver or a
		// browser reads as an address: refused here, before they cost a
		// tool call, not only when dialled.
		{"http://0/", true},
		{"http://0.0.0.0/", true},
		{"http://2130706433/", true},
		{"http://0177.0.0.1/", true},
		{"http://0177.1/", true},
		{"http://127.1/", true},
		{"http://127.0.1/", true},
		{"http://0x7f000001/", true},
		{"http://0X7F000001/", true},
		{"http://0x7f.1/", true},
		{"http://0x7f.0.0.0x1/", true},
		{"http://0x7f.0x0.0x0.0x1/", true},
		{"http://0177.0x0.1/", true},
		{"http://00000177.0.0.1/", true},
		{"http://127.0.0.1./", true},
		{"http://１２７.０.０.１/", true},
		{"http://127。0。0。1/", true},
		{"http://167772161/", true},  // 10.0.0.1
		{"http://0xa9fea9fe/", true}, // 169.254.169.254
		{"http://0251.0376.0251.0376/", true},
		{"http://3232235777:8080/", true}, // 192.168.1.1
		{"http://[::ffff:7f00:1]/", true},
		{"http://[0:0:0:0:0:ffff:127.0.0.1]/", true},
		{"http://[::127.0.0.1]/", true},
		// Ends in a number but is no address: no name can, and a resolver
		// may read it otherwise.
		{"http://256.1/", true},
		{"http://1.2.3.4.5/", true},
		{"http://4294967296/", true},
		{"http://0x100000000/", true},
		{"http://example.0x1/", true},
		{"http://08.1/", true}, // 8 is no octal digit
		// Public addresses in the old forms pass, as names that merely
		// hold digits do.
		{"http://134744072/", false}, // 8.8.8.8
		{"http://0x08080808/", false},
		{"http://8.8.2056/", false}, // 8.8.8.8
		{"http://1e100.net/", false},
		{"http://123.example.org/", false},
		{"http://cafe.bad/", false},
	} {
		err := CheckFetchURL(tc.url)
		if tc.refuse != (err != nil) || (err != nil && !errors.Is(err, ErrFetchRefused)) {
			t.Errorf("%q: %v, want refused %v", tc.url, err, tc.refuse)
		}
	}
}
