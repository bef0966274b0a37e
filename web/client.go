package web

import (
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"path"
)

// The typed client module and its declarations, as files of the page tree.
const (
	clientModule = "client.js"
	clientTypes  = "client.d.ts"
)

// ErrClientMissing: the page tree lacks the client module or its types.
var ErrClientMissing = errors.New("web: client.js or client.d.ts missing")

// Client serves the typed API client for other frontends: GET …/client.js
// (an ES module) and GET …/client.d.ts (its TypeScript declarations), by
// the last element of the path, so it can be mounted at /api/client.js and
// /api/client.d.ts. The URLs carry no version, so answers are revalidated
// (no-cache with an ETag: a deploy shows at once, an unchanged file costs a
// 304). The page itself imports the same file from its versioned assets.
func Client() http.Handler {
	h, err := ClientHandler(Files())
	if err != nil {
		// Both files are embedded; TestClientHandler proves they are there.
		panic(err.Error())
	}
	return h
}

// ClientHandler is Client over another page tree (tests pass fstest.MapFS).
func ClientHandler(fsys fs.FS) (http.Handler, error) {
	files := map[string]file{}
	for _, name := range []string{clientModule, clientTypes} {
		body, err := fs.ReadFile(fsys, name)
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrClientMissing, err)
		}
		files[name] = newFile(body, contentType(name), modTime(fsys, name))
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Content-Type-Options", "nosniff")
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
			return
		}
		name := path.Base(r.URL.Path)
		f, ok := files[name]
		if !ok {
			http.NotFound(w, r)
			return
		}
		if name == clientModule {
			// Deno and other TypeScript-aware importers find the types here;
			// browsers ignore it.
			w.Header().Set("X-TypeScript-Types", "./"+clientTypes)
		}
		sendFile(w, r, f, cacheRevalidate)
	}), nil
}
