package codes_test

import (
	"fmt"
	"go/ast"
	"go/token"
	"strconv"
	"strings"
	"testing"
)

// otherWires are the packages whose strings are another party's words,
// not faregate's vocabulary, each with why: a code string there is that
// wire's, and an error object there is not faregate's envelope.
var otherWires = map[string]string{
	"agent/offline":     "the offline demo model answers as a model provider does: OpenAI's error objects and codes",
	"cmd/example-agent": "an operator's agent: its error answer is the agent's side of the delivery",
}

// tableWriters are the functions that write faregate's error envelope:
// the API's one table (api/codes.go's rows, api/errors.go) pre-encodes
// each envelope and its writers answer with it, in the API's shape and in
// OpenAI's for /v1. Everyone else hands an error to one of them (the
// gateway through Options.Errors, the guards through their Refuse or
// onError).
var tableWriters = map[string]bool{
	"api.newErrorTable":          true,
	"api.(*server).writeErr":     true,
	"api.(*server).WriteV1Error": true,
	"api.(*server).v1ErrorBody":  true,
}

// codeStrings reads the values of codes.go's constants.
func codeStrings(t *testing.T) map[string]bool {
	t.Helper()
	out := map[string]bool{}
	for _, s := range sources(t) {
		if s.path != "protect/codes/codes.go" {
			continue
		}
		ast.Inspect(s.file, func(n ast.Node) bool {
			if lit, ok := n.(*ast.BasicLit); ok && lit.Kind == token.STRING {
				v, _ := strconv.Unquote(lit.Value)
				out[v] = true
			}
			return true
		})
	}
	if len(out) < 40 {
		t.Fatalf("only %d codes read from protect/codes/codes.go", len(out))
	}
	return out
}

// walk calls f for every node of the module's own hand-written code
// (otherWires and generated files left out) with the function it is in.
func walk(t *testing.T, f func(s source, fn string, n ast.Node)) {
	t.Helper()
	for _, s := range sources(t) {
		if _, other := otherWires[s.dir]; other || s.generated() {
			continue
		}
		for _, d := range s.file.Decls {
			fn := s.dir + "."
			if fd, ok := d.(*ast.FuncDecl); ok {
				fn += funcName(fd)
			}
			ast.Inspect(d, func(n ast.Node) bool {
				if fl, ok := n.(*ast.Field); ok && fl.Tag != nil {
					// A struct tag names a JSON member, not a value.
					ast.Inspect(fl.Type, func(n ast.Node) bool { f(s, fn, n); return true })
					return false
				}
				f(s, fn, n)
				return true
			})
		}
	}
}

func funcName(fd *ast.FuncDecl) string {
	if fd.Recv == nil || len(fd.Recv.List) == 0 {
		return fd.Name.Name
	}
	switch r := fd.Recv.List[0].Type.(type) {
	case *ast.StarExpr:
		if id, ok := r.X.(*ast.Ident); ok {
			return "(*" + id.Name + ")." + fd.Name.Name
		}
	case *ast.Ident:
		return r.Name + "." + fd.Name.Name
	}
	return fd.Name.Name
}

// containsWord reports whether w occurs in s with no letter, digit or
// underscore on either side: "internal_error" in `"code":"internal_error"`,
// not "invalid_request" in OpenAI's "invalid_request_error".
func containsWord(s, w string) bool {
	for i := 0; ; {
		j := strings.Index(s[i:], w)
		if j < 0 {
			return false
		}
		a, b := i+j, i+j+len(w)
		if (a == 0 || !wordByte(s[a-1])) && (b == len(s) || !wordByte(s[b])) {
			return true
		}
		i = a + 1
	}
}

func wordByte(c byte) bool {
	return c == '_' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}

// TestCodesAreNamedNotWritten: no string literal of the module's own code
// holds one of faregate's codes, outside protect/codes: a code is written
// once, and everyone else names its constant (a message or a metric's
// help that mentions one joins the constant in). Wire strings of other
// parties are left out by package (otherWires), generated files whole.
func TestCodesAreNamedNotWritten(t *testing.T) {
	codes := codeStrings(t)
	walk(t, func(s source, fn string, n ast.Node) {
		lit, ok := n.(*ast.BasicLit)
		if !ok || lit.Kind != token.STRING || s.dir == "protect/codes" {
			return
		}
		v, err := strconv.Unquote(lit.Value)
		if err != nil {
			return
		}
		for c := range codes {
			if containsWord(v, c) {
				t.Errorf("%s: the literal %s writes the code %q: name its constant from faregate/protect/codes",
					s.fset.Position(lit.Pos()), clip(lit.Value), c)
			}
		}
	})
}

// TestEnvelopesComeFromTheTable: outside the table's writers
// (tableWriters), no code builds faregate's error envelope, {"error":
// {"code", "message", …}}: neither as JSON text nor as a map or struct
// under an "error" member. A refusal goes to the writer as an error value.
// Each function tableWriters names must exist.
func TestEnvelopesComeFromTheTable(t *testing.T) {
	seen := map[string]bool{}
	walk(t, func(s source, fn string, n ast.Node) {
		if tableWriters[fn] {
			seen[fn] = true
			return
		}
		var at token.Pos
		var what string
		switch n := n.(type) {
		case *ast.BasicLit:
			v, err := strconv.Unquote(n.Value)
			if n.Kind == token.STRING && err == nil && envelopeText(v) {
				at, what = n.Pos(), "the literal "+clip(n.Value)
			}
		case *ast.KeyValueExpr:
			if errorMember(n.Key) && holdsObject(n.Value) {
				at, what = n.Pos(), `an "error" member built of `+fmt.Sprintf("%T", n.Value)
			}
		case *ast.AssignStmt:
			for i, l := range n.Lhs {
				if ix, ok := l.(*ast.IndexExpr); ok && errorMember(ix.Index) && i < len(n.Rhs) && holdsObject(n.Rhs[i]) {
					at, what = n.Pos(), `an "error" member set to `+fmt.Sprintf("%T", n.Rhs[i])
				}
			}
		}
		if what != "" {
			t.Errorf("%s (in %s): %s builds an error envelope outside the table's writers: pass the error to the writer (api's, or the gateway's Options.Errors)",
				s.fset.Position(at), fn, what)
		}
	})
	for fn := range tableWriters {
		if !seen[fn] {
			t.Errorf("tableWriters names %s, which no longer exists: name the table's writers as they are", fn)
		}
	}
}

// envelopeText reports JSON text that opens an error envelope.
func envelopeText(v string) bool {
	v = strings.Join(strings.Fields(v), "")
	return strings.Contains(v, `"error":{`)
}

// errorMember reports the string literal "error".
func errorMember(e ast.Expr) bool {
	lit, ok := e.(*ast.BasicLit)
	if !ok || lit.Kind != token.STRING {
		return false
	}
	v, _ := strconv.Unquote(lit.Value)
	return v == "error"
}

// holdsObject reports a value that can be an object: a composite literal,
// one's address, or a variable (a message string is a call or a literal).
func holdsObject(e ast.Expr) bool {
	switch e := e.(type) {
	case *ast.CompositeLit:
		return true
	case *ast.UnaryExpr:
		_, ok := e.X.(*ast.CompositeLit)
		return ok
	case *ast.Ident:
		return e.Name != "nil"
	}
	return false
}

func clip(s string) string {
	if len(s) > 80 {
		return s[:80] + "…"
	}
	return s
}
