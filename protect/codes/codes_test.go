package codes_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// initialisms are the words Go spells in capitals in a constant's name.
var initialisms = map[string]string{"api": "API", "ip": "IP", "aitf": "AITF"}

var codeRE = regexp.MustCompile(`^[a-z][a-z0-9]*(_[a-z0-9]+)*$`)

// TestNamesAreCodes: every constant is a snake_case code named by its own
// CamelCase, and each string is defined once, so a code has one name that
// anyone can guess from the code.
func TestNamesAreCodes(t *testing.T) {
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, "codes.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]string{}
	n := 0
	for _, d := range f.Decls {
		g, ok := d.(*ast.GenDecl)
		if !ok || g.Tok != token.CONST {
			t.Errorf("%s: codes.go holds constants only", fset.Position(d.Pos()))
			continue
		}
		for _, s := range g.Specs {
			vs := s.(*ast.ValueSpec)
			for i, name := range vs.Names {
				lit, ok := vs.Values[i].(*ast.BasicLit)
				if !ok || lit.Kind != token.STRING {
					t.Errorf("%s is not a string literal", name.Name)
					continue
				}
				v, _ := strconv.Unquote(lit.Value)
				n++
				if !codeRE.MatchString(v) || len(v) > 64 {
					t.Errorf("%s = %q is not a snake_case code of at most 64 bytes", name.Name, v)
				}
				if want := camel(v); name.Name != want {
					t.Errorf("%s = %q: name it %s", name.Name, v, want)
				}
				if other, dup := seen[v]; dup {
					t.Errorf("%q is defined twice: %s and %s", v, other, name.Name)
				}
				seen[v] = name.Name
			}
		}
	}
	if n < 40 {
		t.Fatalf("only %d codes read from codes.go", n)
	}
}

func camel(code string) string {
	var b strings.Builder
	for w := range strings.SplitSeq(code, "_") {
		if up, ok := initialisms[w]; ok {
			b.WriteString(up)
			continue
		}
		b.WriteString(strings.ToUpper(w[:1]) + w[1:])
	}
	return b.String()
}
