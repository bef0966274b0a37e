package web

import (
	"bytes"
	"errors"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"testing/fstest"
)

// TestClientHandler: /api/client.js and /api/client.d.ts are the embedded
// files with exact types, revalidated (their URLs carry no version) and
// gzipped for clients that take it.
func TestClientHandler(t *testing.T) {
	h := Client()
	tests := []struct {
		name, path, ctype, file string
	}{
		{"module", "/api/client.js", "text/javascript; charset=utf-8", "client.js"},
		{"types", "/api/client.d.ts", "application/typescript; charset=utf-8", "client.d.ts"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			rec := do(h, http.MethodGet, tc.path, nil)
			if rec.Code != http.StatusOK {
				t.Fatalf("status %d", rec.Code)
			}
			hdr := rec.Header()
			if hdr.Get("Content-Type") != tc.ctype || hdr.Get("Cache-Control") != "no-cache" || hdr.Get("X-Content-Type-Options") != "nosniff" {
				t.Errorf("Content-Type %q, Cache-Control %q, nosniff %q", hdr.Get("Content-Type"), hdr.Get("Cache-Control"), hdr.Get("X-Content-Type-Options"))
			}
			if !bytes.Equal(rec.Body.Bytes(), readStatic(t, tc.file)) {
				t.Error("body differs from the embedded file")
			}
			if rec := do(h, http.MethodGet, tc.path, map[string]string{"If-None-Match": hdr.Get("ETag")}); rec.Code != http.StatusNotModified {
				t.Errorf("revalidation: status %d, want 304", rec.Code)
			}
			if rec := do(h, http.MethodGet, tc.path, map[string]string{"Accept-Encoding": "gzip"}); rec.Header().Get("Content-Encoding") != "gzip" {
				t.Error("not gzipped for a client that accepts it")
			}
		})
	}
	if got := do(h, http.MethodGet, "/api/client.js", nil).Header().Get("X-TypeScript-Types"); got != "./client.d.ts" {
		t.Errorf("X-TypeScript-Types %q", got)
	}
	if rec := do(h, http.MethodGet, "/api/app.js", nil); rec.Code != http.StatusNotFound {
		t.Errorf("another page file: status %d, want 404", rec.Code)
	}
	if rec := do(h, http.MethodPost, "/api/client.js", nil); rec.Code != http.StatusMethodNotAllowed || rec.Header().Get("Allow") != "GET, HEAD" {
		t.Errorf("POST: status %d, Allow %q", rec.Code, rec.Header().Get("Allow"))
	}
	if _, err := ClientHandler(fstest.MapFS{"client.js": {Data: []byte("export {};")}}); !errors.Is(err, ErrClientMissing) {
		t.Errorf("a tree without client.d.ts: err %v, want ErrClientMissing", err)
	}
}

var importRE = regexp.MustCompile(`(?m)^import .* from '\./([a-z]+\.js)';$`)

// TestPageUsesClient: the page reaches the server only through client.js,
// the module other frontends load, so the browser tests exercise it.
func TestPageUsesClient(t *testing.T) {
	var imports []string
	for _, m := range importRE.FindAllSubmatch(readStatic(t, "app.js"), -1) {
		imports = append(imports, string(m[1]))
	}
	if !strings.Contains(strings.Join(imports, " "), "client.js") {
		t.Errorf("app.js imports %v, not client.js", imports)
	}
	index := string(readStatic(t, "index.html"))
	if !strings.Contains(index, `<link rel="modulepreload" href="{{ASSETS}}client.js">`) {
		t.Error("index.html does not preload client.js")
	}
	for _, name := range []string{"app.js", "messages.js", "validate.js", "turnstile.js"} {
		// Only the client speaks HTTP; the rest stay testable without a server.
		if src := readStatic(t, name); bytes.Contains(src, []byte("fetch(")) || bytes.Contains(src, []byte("EventSource")) {
			t.Errorf("%s talks to the server itself", name)
		}
	}
	if _, err := Files().Open("api.js"); err == nil {
		t.Error("the hand-written api.js is still embedded")
	}
}
