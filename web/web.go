// Package web serves the visitor page: index.html at "/" (never cached, so
// a deploy shows at once) and every other file under
// "/assets/<version>/<file>", where version is a content hash of all assets,
// so those answers can be cached for a year. Every answer carries the
// page's security headers; CSP is exported because the API sets it too.
// Revalidation (ETag, and Last-Modified when the file system keeps mod
// times) and ranges are http.ServeContent's; choosing gzip is ours.
package web

import (
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"mime"
	"net/http"
	"net/url"
	"path"
	"strconv"
	"strings"
	"time"
)

// DefaultTurnstileScriptURL is Cloudflare's widget script.
const DefaultTurnstileScriptURL = "https://challenges.cloudflare.com/turnstile/v0/api.js"

// AssetPlaceholder is replaced in index.html by the versioned asset base,
// e.g. "/assets/3f9a0c1d2e4b/".
const AssetPlaceholder = "{{ASSETS}}"

const (
	indexName     = "index.html"
	assetPrefix   = "/assets/"
	versionLength = 12
	cacheForever  = "public, max-age=31536000, immutable"
	// no-cache still lets the browser keep the page, but it must ask first;
	// the ETag turns that question into a cheap 304.
	cacheRevalidate = "no-cache"
)

// Errors returned by Handler.
var (
	ErrNoIndex   = errors.New("web: index.html missing")
	ErrScriptURL = errors.New("web: Turnstile script URL must be an absolute http(s) URL")
	ErrRead      = errors.New("web: reading the page files")
)

// Options configures Handler.
type Options struct {
	// TurnstileScriptURL is where the page loads the widget from; its
	// origin is allowed for scripts and frames. Empty means
	// DefaultTurnstileScriptURL.
	TurnstileScriptURL string
}

// file is one ready-to-send answer body, with its gzip form when that is
// smaller.
type file struct {
	body  []byte
	gz    []byte
	ctype string
	etag  string
	// modTime is the file system's (zero when it keeps none, as embed.FS
	// does: then the answer has no Last-Modified, only the ETag).
	modTime time.Time
}

type handler struct {
	csp     string
	version string
	index   file
	assets  map[string]file
}

// Handler serves the page tree fsys (index.html at its top). All files are
// read, hashed and compressed once, here, so requests never touch fsys.
func Handler(fsys fs.FS, o Options) (http.Handler, error) {
	origin, err := scriptOrigin(o.TurnstileScriptURL)
	if err != nil {
		return nil, err
	}
	indexBody, err := fs.ReadFile(fsys, indexName)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNoIndex, err)
	}
	assets, version, err := loadAssets(fsys)
	if err != nil {
		return nil, err
	}
	page := bytes.ReplaceAll(indexBody, []byte(AssetPlaceholder), []byte(assetPrefix+version+"/"))
	index := newFile(page, "text/html; charset=utf-8", modTime(fsys, indexName))
	// The served page names the assets' version, so it changes with any
	// of them: it is as new as the newest file.
	for _, a := range assets {
		if a.modTime.After(index.modTime) {
			index.modTime = a.modTime
		}
	}
	return &handler{csp: cspFor(origin), version: version, index: index, assets: assets}, nil
}

// modTime is name's modification time, or zero when fsys keeps none.
func modTime(fsys fs.FS, name string) time.Time {
	if fi, err := fs.Stat(fsys, name); err == nil {
		return fi.ModTime()
	}
	return time.Time{}
}

// loadAssets reads every file but index.html. The version hashes names and
// contents in WalkDir's lexical order, so equal trees give equal versions.
func loadAssets(fsys fs.FS) (map[string]file, string, error) {
	assets := map[string]file{}
	sum := sha256.New()
	err := fs.WalkDir(fsys, ".", func(name string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() || name == indexName {
			return nil
		}
		body, err := fs.ReadFile(fsys, name)
		if err != nil {
			return err
		}
		// Length prefixes keep ("ab","c") and ("a","bc") from hashing alike.
		fmt.Fprintf(sum, "%d:%s%d:", len(name), name, len(body))
		sum.Write(body)
		assets[name] = newFile(body, contentType(name), modTime(fsys, name))
		return nil
	})
	if err != nil {
		return nil, "", fmt.Errorf("%w: %w", ErrRead, err)
	}
	return assets, hex.EncodeToString(sum.Sum(nil))[:versionLength], nil
}

func newFile(body []byte, ctype string, mod time.Time) file {
	h := sha256.Sum256(body)
	f := file{body: body, ctype: ctype, etag: `"` + hex.EncodeToString(h[:8]) + `"`, modTime: mod}
	if compressible(ctype) {
		var buf bytes.Buffer
		// Writes to a bytes.Buffer cannot fail and the level is a valid
		// constant, so the errors below are always nil.
		zw, _ := gzip.NewWriterLevel(&buf, gzip.BestCompression)
		_, _ = zw.Write(body)
		_ = zw.Close()
		if buf.Len() < len(body) {
			f.gz = buf.Bytes()
		}
	}
	return f
}

// contentType names the types the page uses explicitly: mime's system
// tables differ between machines (.js was application/javascript on some).
func contentType(name string) string {
	if strings.HasSuffix(name, ".d.ts") {
		// TypeScript declarations; mime's tables call ".ts" MPEG video.
		return "application/typescript; charset=utf-8"
	}
	switch path.Ext(name) {
	case ".js", ".mjs":
		return "text/javascript; charset=utf-8"
	case ".css":
		return "text/css; charset=utf-8"
	case ".svg":
		return "image/svg+xml"
	case ".json":
		return "application/json"
	case ".html":
		return "text/html; charset=utf-8"
	case ".png":
		return "image/png"
	case ".ico":
		return "image/x-icon"
	case ".woff2":
		return "font/woff2"
	case ".txt":
		return "text/plain; charset=utf-8"
	}
	if t := mime.TypeByExtension(path.Ext(name)); t != "" {
		return t
	}
	return "application/octet-stream"
}

func compressible(ctype string) bool {
	return strings.HasPrefix(ctype, "text/") || ctype == "image/svg+xml" || ctype == "application/json" ||
		strings.HasPrefix(ctype, "application/typescript")
}

// scriptOrigin returns scheme://host of the widget script URL.
func scriptOrigin(raw string) (string, error) {
	if raw == "" {
		raw = DefaultTurnstileScriptURL
	}
	u, err := url.Parse(raw)
	if err != nil {
		return "", fmt.Errorf("%w: %w", ErrScriptURL, err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return "", fmt.Errorf("%w: %q", ErrScriptURL, raw)
	}
	return u.Scheme + "://" + u.Host, nil
}

// CSP returns the Content-Security-Policy for the page and the API: only
// this origin, plus the Turnstile origin for its script and its frame.
// An unusable URL leaves the Turnstile origin out, which fails closed: the
// widget will not load, but nothing else becomes allowed.
func CSP(turnstileScriptURL string) string {
	origin, err := scriptOrigin(turnstileScriptURL)
	if err != nil {
		origin = ""
	}
	return cspFor(origin)
}

func cspFor(origin string) string {
	script, frame := "'self'", "'none'"
	if origin != "" {
		script += " " + origin
		frame = origin
	}
	return "default-src 'self'; script-src " + script + "; frame-src " + frame +
		"; connect-src 'self'; img-src 'self' data:; style-src 'self'; base-uri 'none'" +
		"; form-action 'self'; object-src 'none'; frame-ancestors 'none'"
}

func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	hdr := w.Header()
	hdr.Set("Content-Security-Policy", h.csp)
	hdr.Set("X-Content-Type-Options", "nosniff")
	hdr.Set("Referrer-Policy", "strict-origin-when-cross-origin")
	// For browsers that predate frame-ancestors.
	hdr.Set("X-Frame-Options", "DENY")

	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		hdr.Set("Allow", "GET, HEAD")
		http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
		return
	}
	p := r.URL.Path
	if p == "/" {
		sendFile(w, r, h.index, cacheRevalidate)
		return
	}
	rest, ok := strings.CutPrefix(p, assetPrefix)
	if !ok {
		http.NotFound(w, r)
		return
	}
	version, name, ok := strings.Cut(rest, "/")
	// An old version is not served from new files: the hash would lie, and
	// a year-long cache would keep the mismatch.
	if !ok || version != h.version {
		http.NotFound(w, r)
		return
	}
	f, ok := h.assets[name]
	if !ok {
		http.NotFound(w, r)
		return
	}
	sendFile(w, r, f, cacheForever)
}

// sendFile writes f, gzipped when the client accepts it. http.ServeContent
// answers the conditions (If-None-Match against the ETag, and
// If-Modified-Since when the file system keeps mod times: 304; If-Match
// and If-Unmodified-Since: 412), HEAD, and Range (206, over the encoding
// sent, as HTTP defines it).
func sendFile(w http.ResponseWriter, r *http.Request, f file, cache string) {
	hdr := w.Header()
	body, etag := f.body, f.etag
	if f.gz != nil {
		hdr.Add("Vary", "Accept-Encoding")
		if acceptsGzip(r.Header.Get("Accept-Encoding")) {
			body = f.gz
			// A different representation needs a different tag.
			etag = strings.TrimSuffix(f.etag, `"`) + `-gz"`
			hdr.Set("Content-Encoding", "gzip")
		}
	}
	hdr.Set("Cache-Control", cache)
	hdr.Set("ETag", etag)
	hdr.Set("Content-Type", f.ctype)
	http.ServeContent(w, r, "", f.modTime, bytes.NewReader(body))
}

// acceptsGzip reads an Accept-Encoding header: gzip (or *) with a q-value
// above zero.
func acceptsGzip(header string) bool {
	star := false
	for part := range strings.SplitSeq(header, ",") {
		coding, params, _ := strings.Cut(part, ";")
		coding = strings.ToLower(strings.TrimSpace(coding))
		if coding != "gzip" && coding != "x-gzip" && coding != "*" {
			continue
		}
		q := 1.0
		for param := range strings.SplitSeq(params, ";") {
			k, v, _ := strings.Cut(strings.TrimSpace(param), "=")
			if strings.EqualFold(k, "q") {
				if n, err := strconv.ParseFloat(strings.TrimSpace(v), 64); err == nil {
					q = n
				}
			}
		}
		if coding == "*" {
			star = q > 0
			continue
		}
		// An explicit gzip entry decides, whatever "*" says.
		return q > 0
	}
	return star
}
