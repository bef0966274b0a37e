package web

import (
	"embed"
	"io/fs"
)

// static holds the page exactly as it is served: plain HTML, CSS and ES
// modules, no build step.
//
//go:embed static
var static embed.FS

// Files returns the embedded page tree, rooted so that "index.html" sits at
// the top, ready for Handler.
func Files() fs.FS {
	sub, err := fs.Sub(static, "static")
	if err != nil {
		// fs.Sub fails only for an invalid path name; "static" is a
		// constant checked by the compiler's embed directive.
		panic("web: embedded tree: " + err.Error())
	}
	return sub
}
