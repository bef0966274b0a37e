package web

import (
	"bytes"
	"compress/gzip"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"testing/fstest"
	"time"

	"golang.org/x/net/html"

	"faregate/api"
)

// The codes that need words are the API's table's (api/codes.go), plus the
// page's own conditions and the fallbacks for a code the page does not
// know. contract_test.go checks the other direction: the tables name no
// code but these.
var (
	pageConditions = []string{"network", "unknown", "config", "turnstile_load", "turnstile_widget"}
	errorCodes     = append(api.Codes(), pageConditions...)
	taskErrorCodes = append(api.TaskErrorCodes(), "unknown")
	warningCodes   = append(api.WarningCodes(), "unknown")
)

var versionRE = regexp.MustCompile(`/assets/([0-9a-f]{8,12})/app\.js`)

// newHandler builds the handler or stops the test.
func newHandler(t *testing.T, fsys fs.FS, o Options) http.Handler {
	t.Helper()
	h, err := Handler(fsys, o)
	if err != nil {
		t.Fatalf("Handler: %v", err)
	}
	return h
}

// do sends one request through h and returns the recorded answer.
func do(h http.Handler, method, target string, header map[string]string) *httptest.ResponseRecorder {
	req := httptest.NewRequest(method, target, nil)
	for k, v := range header {
		req.Header.Set(k, v)
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec
}

// version reads the asset version the served index points at.
func version(t *testing.T, h http.Handler) string {
	t.Helper()
	m := versionRE.FindStringSubmatch(do(h, http.MethodGet, "/", nil).Body.String())
	if m == nil {
		t.Fatal("index does not reference /assets/<version>/app.js")
	}
	return m[1]
}

// readStatic reads one embedded page file.
func readStatic(t *testing.T, name string) []byte {
	t.Helper()
	b, err := fs.ReadFile(Files(), name)
	if err != nil {
		t.Fatalf("read %s: %v", name, err)
	}
	return b
}

// TestIndex: the page itself is revalidated on every load (a deploy shows at
// once) and points at the versioned assets.
func TestIndex(t *testing.T) {
	h := newHandler(t, Files(), Options{})
	rec := do(h, http.MethodGet, "/", nil)
	if rec.Code != http.StatusOK {
		t.Fatalf("status %d", rec.Code)
	}
	if got := rec.Header().Get("Cache-Control"); got != "no-cache" {
		t.Errorf("Cache-Control = %q, want no-cache", got)
	}
	if got := rec.Header().Get("Content-Type"); got != "text/html; charset=utf-8" {
		t.Errorf("Content-Type = %q", got)
	}
	body := rec.Body.String()
	v := version(t, h)
	if len(v) != versionLength {
		t.Errorf("version %q has %d hex digits, want %d", v, len(v), versionLength)
	}
	for _, want := range []string{"/assets/" + v + "/style.css", "/assets/" + v + "/favicon.svg"} {
		if !strings.Contains(body, want) {
			t.Errorf("index lacks %s", want)
		}
	}
	if strings.Contains(body, AssetPlaceholder) {
		t.Error("placeholder left in the served index")
	}

	head := do(h, http.MethodHead, "/", nil)
	if head.Code != http.StatusOK || head.Body.Len() != 0 {
		t.Errorf("HEAD: status %d, %d body bytes", head.Code, head.Body.Len())
	}
	if head.Header().Get("Content-Length") != fmt.Sprint(len(body)) {
		t.Errorf("HEAD Content-Length %q, GET body %d bytes", head.Header().Get("Content-Length"), len(body))
	}
}

// TestAssets: versioned files are cacheable for a year and carry exact types;
// a module served with the wrong type is refused under nosniff.
func TestAssets(t *testing.T) {
	h := newHandler(t, Files(), Options{})
	v := version(t, h)
	tests := []struct {
		name, file, ctype string
	}{
		{"app module", "app.js", "text/javascript; charset=utf-8"},
		{"client module", "client.js", "text/javascript; charset=utf-8"},
		{"client types", "client.d.ts", "application/typescript; charset=utf-8"},
		{"messages module", "messages.js", "text/javascript; charset=utf-8"},
		{"stylesheet", "style.css", "text/css; charset=utf-8"},
		{"icon", "favicon.svg", "image/svg+xml"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			rec := do(h, http.MethodGet, "/assets/"+v+"/"+tc.file, nil)
			if rec.Code != http.StatusOK {
				t.Fatalf("status %d", rec.Code)
			}
			if got := rec.Header().Get("Cache-Control"); got != "public, max-age=31536000, immutable" {
				t.Errorf("Cache-Control = %q", got)
			}
			if got := rec.Header().Get("Content-Type"); got != tc.ctype {
				t.Errorf("Content-Type = %q, want %q", got, tc.ctype)
			}
			if !bytes.Equal(rec.Body.Bytes(), readStatic(t, tc.file)) {
				t.Error("body differs from the embedded file")
			}
		})
	}
}

// TestNotFound: only "/" and current asset paths exist; an old or guessed
// version must not be cached for a year under the wrong content.
func TestNotFound(t *testing.T) {
	h := newHandler(t, Files(), Options{})
	v := version(t, h)
	tests := []struct{ name, path string }{
		{"unknown version", "/assets/000000000000/app.js"},
		{"version prefix only", "/assets/" + v[:8] + "/app.js"},
		{"unknown file", "/assets/" + v + "/nope.js"},
		{"index is not an asset", "/assets/" + v + "/index.html"},
		{"dot dot", "/assets/" + v + "/../index.html"},
		{"no file", "/assets/" + v + "/"},
		{"no version", "/assets/app.js"},
		{"index by name", "/index.html"},
		{"other path", "/favicon.ico"},
		{"api is not ours", "/api/config"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if rec := do(h, http.MethodGet, tc.path, nil); rec.Code != http.StatusNotFound {
				t.Errorf("GET %s = %d, want 404", tc.path, rec.Code)
			}
		})
	}
}

// TestMethodNotAllowed: the page is read-only.
func TestMethodNotAllowed(t *testing.T) {
	h := newHandler(t, Files(), Options{})
	for _, m := range []string{http.MethodPost, http.MethodPut, http.MethodDelete} {
		t.Run(m, func(t *testing.T) {
			rec := do(h, m, "/", nil)
			if rec.Code != http.StatusMethodNotAllowed || rec.Header().Get("Allow") != "GET, HEAD" {
				t.Errorf("status %d, Allow %q", rec.Code, rec.Header().Get("Allow"))
			}
		})
	}
}

// TestSecurityHeadersOnEveryAnswer: error answers need the headers too, since
// a browser may render them.
func TestSecurityHeadersOnEveryAnswer(t *testing.T) {
	const script = "http://127.0.0.1:1234/ts.js"
	h := newHandler(t, Files(), Options{TurnstileScriptURL: script})
	v := version(t, h)
	tests := []struct{ name, method, path string }{
		{"index", http.MethodGet, "/"},
		{"asset", http.MethodGet, "/assets/" + v + "/app.js"},
		{"not found", http.MethodGet, "/nope"},
		{"bad method", http.MethodPost, "/"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			hdr := do(h, tc.method, tc.path, nil).Header()
			if got := hdr.Get("Content-Security-Policy"); got != CSP(script) {
				t.Errorf("CSP = %q, want %q", got, CSP(script))
			}
			if got := hdr.Get("X-Content-Type-Options"); got != "nosniff" {
				t.Errorf("X-Content-Type-Options = %q", got)
			}
			if got := hdr.Get("Referrer-Policy"); got != "strict-origin-when-cross-origin" {
				t.Errorf("Referrer-Policy = %q", got)
			}
		})
	}
}

// TestCSP: the policy names the widget's origin, never its path or query,
// and falls back to self-only when the URL is unusable.
func TestCSP(t *testing.T) {
	tests := []struct {
		name, url string
		want      []string
		not       []string
	}{
		{
			name: "default Cloudflare",
			url:  "",
			want: []string{"script-src 'self' https://challenges.cloudflare.com;", "frame-src https://challenges.cloudflare.com;"},
		},
		{
			name: "local stand-in",
			url:  "http://127.0.0.1:1234/ts.js",
			want: []string{"script-src 'self' http://127.0.0.1:1234;", "frame-src http://127.0.0.1:1234;"},
			not:  []string{"challenges.cloudflare.com", "/ts.js"},
		},
		{
			name: "query string stays out",
			url:  "https://example.test/api.js?x=1",
			want: []string{"script-src 'self' https://example.test;"},
			not:  []string{"x=1"},
		},
		{
			name: "unusable URL fails closed",
			url:  "javascript:alert(1)",
			want: []string{"script-src 'self';", "frame-src 'none';"},
			not:  []string{"javascript"},
		},
	}
	common := []string{
		"default-src 'self';", "connect-src 'self';", "img-src 'self' data:;", "style-src 'self';",
		"base-uri 'none';", "form-action 'self';", "object-src 'none';", "frame-ancestors 'none'",
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			csp := CSP(tc.url)
			for _, w := range append(slices.Clone(common), tc.want...) {
				if !strings.Contains(csp, w) {
					t.Errorf("CSP %q lacks %q", csp, w)
				}
			}
			for _, n := range tc.not {
				if strings.Contains(csp, n) {
					t.Errorf("CSP %q contains %q", csp, n)
				}
			}
		})
	}
}

// TestHandlerRejects: configuration mistakes fail at start-up, not per request.
func TestHandlerRejects(t *testing.T) {
	good := fstest.MapFS{"index.html": {Data: []byte("<p>{{ASSETS}}</p>")}}
	tests := []struct {
		name string
		fsys fs.FS
		o    Options
		want error
	}{
		{"no index", fstest.MapFS{"app.js": {Data: []byte("x")}}, Options{}, ErrNoIndex},
		{"script URL without scheme", good, Options{TurnstileScriptURL: "challenges.cloudflare.com/api.js"}, ErrScriptURL},
		{"script URL not http", good, Options{TurnstileScriptURL: "ftp://example.test/a.js"}, ErrScriptURL},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := Handler(tc.fsys, tc.o); !errors.Is(err, tc.want) {
				t.Errorf("err = %v, want %v", err, tc.want)
			}
		})
	}
}

// TestVersionFollowsAssetContent: the version changes exactly when an asset
// does, so caches are neither busted needlessly nor kept stale.
func TestVersionFollowsAssetContent(t *testing.T) {
	tree := func(index, app string) fstest.MapFS {
		return fstest.MapFS{
			"index.html":  {Data: []byte(index)},
			"app.js":      {Data: []byte(app)},
			"i18n/zh.txt": {Data: []byte("zh")},
		}
	}
	const index = `<script type="module" src="{{ASSETS}}app.js"></script>`
	base := version(t, newHandler(t, tree(index, "a"), Options{}))
	tests := []struct {
		name string
		fsys fs.FS
		same bool
	}{
		{"same files", tree(index, "a"), true},
		{"index edits keep assets cached", tree(index+"<p>new</p>", "a"), true},
		{"asset edit", tree(index, "b"), false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := version(t, newHandler(t, tc.fsys, Options{})); (got == base) != tc.same {
				t.Errorf("version %s vs %s, want same=%v", got, base, tc.same)
			}
		})
	}
	// Nested asset paths are served under the same version.
	h := newHandler(t, tree(index, "a"), Options{})
	if rec := do(h, http.MethodGet, "/assets/"+base+"/i18n/zh.txt", nil); rec.Code != http.StatusOK || rec.Body.String() != "zh" {
		t.Errorf("nested asset: status %d body %q", rec.Code, rec.Body.String())
	}
}

// TestGzip: the precompressed form goes only to clients that accept it.
func TestGzip(t *testing.T) {
	h := newHandler(t, Files(), Options{})
	v := version(t, h)
	plain := readStatic(t, "messages.js")
	tests := []struct {
		accept string
		gz     bool
	}{
		{"gzip", true},
		{"br, gzip;q=0.5", true},
		{"*", true},
		{"", false},
		{"br", false},
		{"gzip;q=0", false},
		{"gzip;q=0, *", false},
	}
	for _, tc := range tests {
		t.Run(fmt.Sprintf("%q", tc.accept), func(t *testing.T) {
			rec := do(h, http.MethodGet, "/assets/"+v+"/messages.js", map[string]string{"Accept-Encoding": tc.accept})
			if !strings.Contains(rec.Header().Get("Vary"), "Accept-Encoding") {
				t.Error("no Vary: Accept-Encoding")
			}
			got := rec.Body.Bytes()
			if gz := rec.Header().Get("Content-Encoding") == "gzip"; gz != tc.gz {
				t.Fatalf("gzip = %v, want %v", gz, tc.gz)
			}
			if tc.gz {
				zr, err := gzip.NewReader(bytes.NewReader(got))
				if err != nil {
					t.Fatal(err)
				}
				if got, err = io.ReadAll(zr); err != nil {
					t.Fatal(err)
				}
			}
			if !bytes.Equal(got, plain) {
				t.Error("decoded body differs from the file")
			}
		})
	}
}

// TestConditionalGet: revalidating the no-cache page costs a 304, and the
// gzip and plain forms never share a tag.
func TestConditionalGet(t *testing.T) {
	h := newHandler(t, Files(), Options{})
	plain := do(h, http.MethodGet, "/", nil).Header().Get("ETag")
	zipped := do(h, http.MethodGet, "/", map[string]string{"Accept-Encoding": "gzip"}).Header().Get("ETag")
	if plain == "" || plain == zipped {
		t.Fatalf("ETags %q and %q: want two different tags", plain, zipped)
	}
	tests := []struct {
		name, inm, accept string
		want              int
	}{
		{"same tag", plain, "", http.StatusNotModified},
		{"weak form", "W/" + plain, "", http.StatusNotModified},
		{"in a list", `"x", ` + zipped, "gzip", http.StatusNotModified},
		{"other encoding's tag", zipped, "", http.StatusOK},
		{"stale tag", `"0000"`, "", http.StatusOK},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			rec := do(h, http.MethodGet, "/", map[string]string{"If-None-Match": tc.inm, "Accept-Encoding": tc.accept})
			if rec.Code != tc.want {
				t.Fatalf("status %d, want %d", rec.Code, tc.want)
			}
			if tc.want == http.StatusNotModified && rec.Body.Len() != 0 {
				t.Error("304 with a body")
			}
		})
	}
}

// TestRangesAndDates: the page's files answer a Range with 206 and the
// bytes asked for, in the encoding sent; with a file system that keeps
// mod times they carry Last-Modified (the page: its newest file's, since
// it names every asset's version) and If-Modified-Since costs a 304; the
// embedded files, which keep none, carry only the ETag.
func TestRangesAndDates(t *testing.T) {
	older := time.Date(2026, 11, 1, 12, 0, 0, 0, time.UTC)
	newer := older.Add(24 * time.Hour)
	script := strings.Repeat("console.log('range');\n", 40)
	h := newHandler(t, fstest.MapFS{
		"index.html": {Data: []byte(`<script src="{{ASSETS}}app.js"></script>`), ModTime: older},
		"app.js":     {Data: []byte(script), ModTime: newer},
	}, Options{})
	asset := "/assets/" + version(t, h) + "/app.js"

	rec := do(h, http.MethodGet, asset, map[string]string{"Range": "bytes=8-15"})
	if rec.Code != http.StatusPartialContent || rec.Body.String() != script[8:16] ||
		rec.Header().Get("Content-Range") != fmt.Sprintf("bytes 8-15/%d", len(script)) {
		t.Fatalf("Range: %d %q Content-Range %q", rec.Code, rec.Body, rec.Header().Get("Content-Range"))
	}
	zipped := do(h, http.MethodGet, asset, map[string]string{"Accept-Encoding": "gzip"}).Body.Bytes()
	rec = do(h, http.MethodGet, asset, map[string]string{"Range": "bytes=0-9", "Accept-Encoding": "gzip"})
	if rec.Code != http.StatusPartialContent || !bytes.Equal(rec.Body.Bytes(), zipped[:10]) || rec.Header().Get("Content-Encoding") != "gzip" {
		t.Fatalf("Range over gzip: %d % x, want the first 10 bytes of % x", rec.Code, rec.Body.Bytes(), zipped[:10])
	}

	for path, want := range map[string]time.Time{"/": newer, asset: newer} {
		rec := do(h, http.MethodGet, path, nil)
		if lm := rec.Header().Get("Last-Modified"); lm != want.Format(http.TimeFormat) {
			t.Errorf("%s: Last-Modified %q, want %s", path, lm, want.Format(http.TimeFormat))
		}
		if rec := do(h, http.MethodGet, path, map[string]string{"If-Modified-Since": want.Format(http.TimeFormat)}); rec.Code != http.StatusNotModified {
			t.Errorf("%s: If-Modified-Since its own date: %d, want 304", path, rec.Code)
		}
		if rec := do(h, http.MethodGet, path, map[string]string{"If-Modified-Since": older.Add(-time.Hour).Format(http.TimeFormat)}); rec.Code != http.StatusOK {
			t.Errorf("%s: If-Modified-Since an earlier date: %d, want 200", path, rec.Code)
		}
	}
	if lm := do(h, http.MethodGet, "/", map[string]string{"If-None-Match": `"stale"`}).Header().Get("Last-Modified"); lm == "" {
		t.Error("a 200 to a stale tag lacks Last-Modified")
	}

	embedded := newHandler(t, Files(), Options{})
	if rec := do(embedded, http.MethodGet, "/", nil); rec.Header().Get("Last-Modified") != "" || rec.Header().Get("ETag") == "" {
		t.Errorf("embedded page: Last-Modified %q, ETag %q; want only the ETag", rec.Header().Get("Last-Modified"), rec.Header().Get("ETag"))
	}
}

// unsafeDOM lists every embedded .js file that uses an HTML-parsing sink or
// sets inline styles (blocked by the CSP anyway).
func unsafeDOM(fsys fs.FS) (found []string, scripts int, err error) {
	forbidden := []string{"innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function", ".style.", "cssText"}
	err = fs.WalkDir(fsys, ".", func(name string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(name, ".js") {
			return err
		}
		scripts++
		b, err := fs.ReadFile(fsys, name)
		if err != nil {
			return err
		}
		for _, f := range forbidden {
			if bytes.Contains(b, []byte(f)) {
				found = append(found, name+": "+f)
			}
		}
		return nil
	})
	return found, scripts, err
}

// TestNoUnsafeDOMSinks: model output reaches the page; no module may use an
// API that parses it as HTML.
func TestNoUnsafeDOMSinks(t *testing.T) {
	t.Run("scanner catches a sink", func(t *testing.T) {
		bad := fstest.MapFS{"x/a.js": {Data: []byte("el.innerHTML = data;")}, "b.css": {Data: []byte("innerHTML")}}
		found, n, err := unsafeDOM(bad)
		if err != nil || n != 1 || len(found) != 1 {
			t.Fatalf("found %v in %d scripts, err %v; want one finding in one script", found, n, err)
		}
	})
	t.Run("embedded page", func(t *testing.T) {
		found, n, err := unsafeDOM(Files())
		if err != nil {
			t.Fatal(err)
		}
		if n < 2 {
			t.Fatalf("only %d .js files embedded", n)
		}
		for _, f := range found {
			t.Errorf("forbidden DOM use: %s", f)
		}
	})
}

var tablesRE = regexp.MustCompile(`(?s)export const TABLES = (\{.*?\n\});\n// end of tables`)

// parseTables decodes the TABLES literal of messages.js token by token, so
// a key written twice (which JavaScript would silently accept) is an error.
func parseTables(src []byte) (map[string]map[string]string, error) {
	m := tablesRE.FindSubmatch(src)
	if m == nil {
		return nil, errors.New("no TABLES literal followed by // end of tables")
	}
	dec := json.NewDecoder(bytes.NewReader(m[1]))
	out := map[string]map[string]string{}
	if err := expectDelim(dec, '{'); err != nil {
		return nil, err
	}
	for dec.More() {
		lang, err := stringToken(dec)
		if err != nil {
			return nil, err
		}
		if err := expectDelim(dec, '{'); err != nil {
			return nil, err
		}
		table := map[string]string{}
		for dec.More() {
			key, err := stringToken(dec)
			if err != nil {
				return nil, err
			}
			val, err := stringToken(dec)
			if err != nil {
				return nil, fmt.Errorf("%s.%s: %w", lang, key, err)
			}
			if _, dup := table[key]; dup {
				return nil, fmt.Errorf("%s: key %q twice", lang, key)
			}
			table[key] = val
		}
		if err := expectDelim(dec, '}'); err != nil {
			return nil, err
		}
		out[lang] = table
	}
	return out, expectDelim(dec, '}')
}

// expectDelim reads one JSON delimiter.
func expectDelim(dec *json.Decoder, want json.Delim) error {
	tok, err := dec.Token()
	if err != nil {
		return err
	}
	if tok != want {
		return fmt.Errorf("got %v, want %v", tok, want)
	}
	return nil
}

// stringToken reads one JSON string.
func stringToken(dec *json.Decoder) (string, error) {
	tok, err := dec.Token()
	if err != nil {
		return "", err
	}
	s, ok := tok.(string)
	if !ok {
		return "", fmt.Errorf("got %v, want a string", tok)
	}
	return s, nil
}

// tables parses the message tables of the embedded messages.js.
func tables(t *testing.T) map[string]map[string]string {
	t.Helper()
	tabs, err := parseTables(readStatic(t, "messages.js"))
	if err != nil {
		t.Fatalf("messages.js: %v", err)
	}
	return tabs
}

var slotRE = regexp.MustCompile(`\{(\w+)\}`)

// slots lists the distinct {name} slots of a message.
func slots(s string) []string {
	var out []string
	for _, m := range slotRE.FindAllStringSubmatch(s, -1) {
		out = append(out, m[1])
	}
	sort.Strings(out)
	return slices.Compact(out)
}

// TestMessageTables: both languages say everything, with the same slots, and
// every code the server may send has its own message and next step.
func TestMessageTables(t *testing.T) {
	tabs := tables(t)
	en, zh := tabs["en"], tabs["zh-CN"]
	if len(tabs) != 2 || en == nil || zh == nil {
		t.Fatalf("languages %v, want en and zh-CN", slices.Sorted(func(yield func(string) bool) {
			for k := range tabs {
				if !yield(k) {
					return
				}
			}
		}))
	}
	t.Run("same keys and slots", func(t *testing.T) {
		for k, v := range en {
			z, ok := zh[k]
			if !ok {
				t.Errorf("zh-CN lacks %q", k)
				continue
			}
			if v == "" || z == "" {
				t.Errorf("%q is empty in a table", k)
			}
			if !slices.Equal(slots(v), slots(z)) {
				t.Errorf("%q: slots %v in en, %v in zh-CN", k, slots(v), slots(z))
			}
		}
		for k := range zh {
			if _, ok := en[k]; !ok {
				t.Errorf("en lacks %q", k)
			}
		}
	})
	t.Run("every error code", func(t *testing.T) {
		for _, code := range errorCodes {
			for _, key := range []string{"err." + code, "err." + code + ".next"} {
				if en[key] == "" || zh[key] == "" {
					t.Errorf("no %q in both tables", key)
				}
			}
		}
	})
	t.Run("every task error code", func(t *testing.T) {
		for _, code := range taskErrorCodes {
			for _, key := range []string{"taskerr." + code, "taskerr." + code + ".next"} {
				if en[key] == "" || zh[key] == "" {
					t.Errorf("no %q in both tables", key)
				}
			}
		}
		// A failed task keeps its quota slot; its message must not say otherwise.
		for _, code := range taskErrorCodes {
			if !strings.Contains(en["taskerr."+code+".next"], "still counts") {
				t.Errorf("taskerr.%s.next does not say the attempt still counts", code)
			}
		}
	})
	t.Run("every warning code", func(t *testing.T) {
		for _, code := range warningCodes {
			if en["warn."+code] == "" || zh["warn."+code] == "" {
				t.Errorf("no warn.%s in both tables", code)
			}
		}
	})
	t.Run("no code the table does not know", func(t *testing.T) {
		for k := range en {
			for prefix, known := range map[string][]string{"err.": errorCodes, "taskerr.": taskErrorCodes, "warn.": warningCodes} {
				code, ok := strings.CutPrefix(k, prefix)
				if !ok {
					continue
				}
				code = strings.TrimSuffix(strings.TrimSuffix(code, ".next"), ".prompt")
				if !slices.Contains(known, code) {
					t.Errorf("%q: %s is no code of api/codes.go and no page condition", k, code)
				}
			}
		}
	})
	t.Run("prompt form words", func(t *testing.T) { promptFormWords(t, en, zh) })
	t.Run("waiting times", func(t *testing.T) {
		// The issue fixes these forms: "5 h 12 min" and "5 小时 12 分钟".
		want := map[string][2]string{
			"time.h_min": {"{h} h {m} min", "{h} 小时 {m} 分钟"},
			"time.s":     {"{s} s", "{s} 秒"},
			"retry.in":   {"Try again in {rel}.", ""},
		}
		for k, w := range want {
			if en[k] != w[0] || (w[1] != "" && zh[k] != w[1]) {
				t.Errorf("%s = %q / %q, want %q / %q", k, en[k], zh[k], w[0], w[1])
			}
		}
	})
}

// promptShown are the keys (and key prefixes) the page may show in the
// prompt form; the trip form's own fields and the itinerary are not among
// them.
var promptShown = []string{"page.title", "app.", "banner.", "form.heading", "form.submit", "form.check.", "status.",
	"err.", "taskerr.", "task.heading", "task.status.", "task.quota", "task.steps.", "task.result.heading", "task.model", "step.", "warn.", "task.warnings"}

// tripWords are words of the trip form that a prompt-form visitor, who
// asked the agent for anything, must not read.
var tripWords = map[string][]string{"en": {"trip", "plan", "destination", "itinerar", "travel"}, "zh-CN": {"行程", "规划", "目的地", "旅行"}}

// promptFormWords: every message the prompt form can show, as the page
// picks it in that form (key + ".prompt" where the table has it, like
// inputKey in app.js), speaks of the request and the task, not of trips;
// a variant of an error comes with its own next step, and a failed task's
// variant still says the attempt counts.
func promptFormWords(t *testing.T, en, zh map[string]string) {
	for lang, tab := range map[string]map[string]string{"en": en, "zh-CN": zh} {
		for k := range tab {
			if strings.HasSuffix(k, ".prompt") || strings.HasSuffix(k, ".prompt.next") || !slices.ContainsFunc(promptShown, func(p string) bool { return k == p || (strings.HasSuffix(p, ".") && strings.HasPrefix(k, p)) }) {
				continue
			}
			stem, next := strings.CutSuffix(k, ".next")
			shown := k
			if _, ok := tab[stem+".prompt"]; ok {
				shown = stem + ".prompt"
				if next {
					shown += ".next"
				}
			}
			text, ok := tab[shown]
			if !ok {
				t.Errorf("%s: %q has a prompt variant but no %q", lang, stem, shown)
				continue
			}
			for _, w := range tripWords[lang] {
				if strings.Contains(strings.ToLower(text), w) {
					t.Errorf("%s: in the prompt form %q reads %q, which speaks of %q", lang, shown, text, w)
				}
			}
			if lang == "en" && strings.HasPrefix(k, "taskerr.") && next && !strings.Contains(text, "still counts") {
				t.Errorf("%q = %q does not say the attempt still counts", shown, text)
			}
		}
	}
}

var (
	// Literal keys handed to the translation helpers of the modules; a
	// literal followed by "+" is a prefix, checked through the lists below.
	keyUseRE = regexp.MustCompile(`(?:setText\([^,()]+, |translate\(\w+, |\bt\(|key: )'([A-Za-z0-9_.-]+)'\s*[,)}]`)
	// Lists whose entries become keys by prefix in app.js.
	keyListRE = regexp.MustCompile(`const (PRESETS|TASK_STATUSES|STEP_KINDS|STEP_STATUSES) = \[([^\]]*)\]`)
	quotedRE  = regexp.MustCompile(`'([^']+)'`)
)

// TestUsedKeysExist: a key the page uses but the tables lack would show as
// the raw key to visitors.
func TestUsedKeysExist(t *testing.T) {
	en := tables(t)["en"]
	used := map[string]string{} // key → where
	err := fs.WalkDir(Files(), ".", func(name string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(name, ".js") {
			return err
		}
		src := readStatic(t, name)
		for _, m := range keyUseRE.FindAllSubmatch(src, -1) {
			used[string(m[1])] = name
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	prefixes := map[string]string{"PRESETS": "interest.", "TASK_STATUSES": "task.status.", "STEP_KINDS": "step.kind.", "STEP_STATUSES": "step.status."}
	lists := keyListRE.FindAllSubmatch(readStatic(t, "app.js"), -1)
	if len(lists) != len(prefixes) {
		t.Fatalf("found %d key lists in app.js, want %d", len(lists), len(prefixes))
	}
	for _, l := range lists {
		for _, q := range quotedRE.FindAllSubmatch(l[2], -1) {
			used[prefixes[string(l[1])]+string(q[1])] = "app.js " + string(l[1])
		}
	}
	for _, k := range []string{"task.status.unknown", "step.kind.unknown", "step.status.unknown"} {
		used[k] = "app.js fallback"
	}
	for _, n := range htmlNodes(t) {
		if k := attr(n, "data-i18n"); k != "" {
			used[k] = "index.html"
		}
	}
	if len(used) < 40 {
		t.Fatalf("found only %d keys in use; is the pattern still right?", len(used))
	}
	for k, where := range used {
		if _, ok := en[k]; !ok {
			t.Errorf("%s uses %q, which is not in the tables", where, k)
		}
	}
}

// htmlNodes parses index.html and lists its elements.
func htmlNodes(t *testing.T) []*html.Node {
	t.Helper()
	doc, err := html.Parse(bytes.NewReader(readStatic(t, "index.html")))
	if err != nil {
		t.Fatal(err)
	}
	var out []*html.Node
	for n := range doc.Descendants() {
		if n.Type == html.ElementNode {
			out = append(out, n)
		}
	}
	return out
}

// attr returns an attribute's value, or "" when it is absent.
func attr(n *html.Node, name string) string {
	for _, a := range n.Attr {
		if a.Key == name {
			return a.Val
		}
	}
	return ""
}

// hasAttr reports whether the attribute is present at all.
func hasAttr(n *html.Node, name string) bool {
	return slices.ContainsFunc(n.Attr, func(a html.Attribute) bool { return a.Key == name })
}

// TestIndexMarkup: nothing inline that the CSP would block, every field
// labelled, one polite live region, and the ids browser tests drive.
func TestIndexMarkup(t *testing.T) {
	nodes := htmlNodes(t)
	ids := map[string]bool{}
	labelled := map[string]bool{}
	var live int
	for _, n := range nodes {
		if id := attr(n, "id"); id != "" {
			if ids[id] {
				t.Errorf("id %q twice", id)
			}
			ids[id] = true
		}
		if n.Data == "label" {
			labelled[attr(n, "for")] = true
		}
		if attr(n, "aria-live") == "polite" {
			live++
		}
		for _, a := range n.Attr {
			// CSP forbids inline handlers and style attributes.
			if a.Key == "style" || strings.HasPrefix(a.Key, "on") {
				t.Errorf("<%s> has inline %s", n.Data, a.Key)
			}
		}
		switch n.Data {
		case "style":
			t.Error("inline <style> element")
		case "script":
			if attr(n, "src") == "" || (n.FirstChild != nil && strings.TrimSpace(n.FirstChild.Data) != "") {
				t.Error("inline script")
			}
		case "html":
			if attr(n, "lang") == "" {
				t.Error("<html> without lang")
			}
		}
	}
	if live != 1 {
		t.Errorf("%d aria-live=polite regions, want 1", live)
	}
	for _, n := range nodes {
		field := n.Data == "select" || n.Data == "textarea" || (n.Data == "input" && attr(n, "type") != "hidden")
		if field && !labelled[attr(n, "id")] && !hasAttr(n, "aria-label") {
			t.Errorf("<%s id=%q> has no label", n.Data, attr(n, "id"))
		}
		for _, ref := range strings.Fields(attr(n, "aria-describedby") + " " + attr(n, "aria-labelledby")) {
			if !ids[ref] {
				t.Errorf("<%s> refers to missing id %q", n.Data, ref)
			}
		}
	}
	// The ids a browser test drives; renaming one breaks those tests.
	for _, id := range []string{
		"lang", "dev-banner", "offline-note", "model-status", "task-form", "destination", "days",
		"interest-chips", "interest-custom", "interest-add", "turnstile", "submit", "messages",
		"message-text", "message-retry", "message-ref", "task", "task-status", "quota", "steps",
		"result", "summary", "warnings", "days-list", "destination-error", "days-error", "interests-error",
	} {
		if !ids[id] {
			t.Errorf("no element with id %q", id)
		}
	}
}

// TestAssetSize reports the page weight and keeps it small.
func TestAssetSize(t *testing.T) {
	var raw, zipped int
	err := fs.WalkDir(Files(), ".", func(name string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		if strings.HasSuffix(name, ".d.ts") {
			// Types for developers of other frontends (served at
			// /api/client.d.ts); the page never downloads them.
			return nil
		}
		b := readStatic(t, name)
		raw += len(b)
		var buf bytes.Buffer
		zw, _ := gzip.NewWriterLevel(&buf, gzip.BestCompression)
		_, _ = zw.Write(b)
		_ = zw.Close()
		zipped += buf.Len()
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("page: %d bytes, %d bytes gzipped", raw, zipped)
	const budget = 40 << 10
	if zipped > budget {
		t.Errorf("page is %d bytes gzipped, budget %d", zipped, budget)
	}
}
