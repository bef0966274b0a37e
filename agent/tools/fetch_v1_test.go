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
