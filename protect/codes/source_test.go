package codes_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// source is one non-test Go file of the module, parsed.
type source struct {
	path string // slash-separated, from the module's root
	dir  string // its package directory, from the module's root
	file *ast.File
	fset *token.FileSet
}

// generated reports whether the file says it is generated ("Code generated
// … DO NOT EDIT." before the package clause).
func (s source) generated() bool {
	return ast.IsGenerated(s.file)
}

var (
	sourcesOnce sync.Once
	sourcesAll  []source
	sourcesErr  error
)

// sources parses every non-test Go file of the module once per test binary.
func sources(t *testing.T) []source {
	t.Helper()
	sourcesOnce.Do(func() { sourcesAll, sourcesErr = parseModule() })
	if sourcesErr != nil {
		t.Fatal(sourcesErr)
	}
	if len(sourcesAll) < 100 {
		t.Fatalf("only %d Go files found: is the module's root where the test looks?", len(sourcesAll))
	}
	return sourcesAll
}

func parseModule() ([]source, error) {
	root, err := moduleRoot()
	if err != nil {
		return nil, err
	}
	fset := token.NewFileSet()
	var out []source
	err = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if name := d.Name(); p != root && (strings.HasPrefix(name, ".") || name == "testdata") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, p, nil, parser.ParseComments|parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		rel = filepath.ToSlash(rel)
		out = append(out, source{path: rel, dir: pathDir(rel), file: f, fset: fset})
		return nil
	})
	return out, err
}

// moduleRoot is the nearest directory above the test's that holds go.mod.
func moduleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		up := filepath.Dir(dir)
		if up == dir {
			return "", os.ErrNotExist
		}
		dir = up
	}
}

func pathDir(p string) string {
	if i := strings.LastIndexByte(p, '/'); i >= 0 {
		return p[:i]
	}
	return "."
}

// under reports whether dir is root or inside it.
func under(dir, root string) bool { return dir == root || strings.HasPrefix(dir, root+"/") }
