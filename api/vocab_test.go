package api_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"faregate/api"
)

// pendingCodes are codes the manual names whose producers are not in the
// API's table yet: the /v1 surface and the external agent's task codes.
// The documents do not list them (they describe what the server answers
// today); remove a code from here when its row or its list entry lands in
// api/codes.go, and the document tests then ask for its enum entry, its
// messages and its client type.
var pendingCodes = []string{}

// codeConstants reads the values of faregate/codes' constants.
func codeConstants(t *testing.T) []string {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), "../protect/codes/codes.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	ast.Inspect(f, func(n ast.Node) bool {
		if lit, ok := n.(*ast.BasicLit); ok && lit.Kind == token.STRING {
			v, _ := strconv.Unquote(lit.Value)
			out = append(out, v)
		}
		return true
	})
	return out
}

// TestVocabularyCoversCodes: every constant of faregate/codes is in the
// API's table (an error row, a task code, a warning) or pending, and only
// the pending are; every code of the table is such a constant. A code
// added to faregate/codes fails here until api/codes.go maps it.
func TestVocabularyCoversCodes(t *testing.T) {
	consts := codeConstants(t)
	if len(consts) < 40 {
		t.Fatalf("only %d constants read", len(consts))
	}
	known := map[string]bool{}
	for _, list := range [][]string{api.Codes(), api.TaskErrorCodes(), api.WarningCodes()} {
		for _, c := range list {
			known[c] = true
			if !slices.Contains(consts, c) {
				t.Errorf("api/codes.go maps %q, which is no constant of faregate/codes", c)
			}
		}
	}
	for _, c := range consts {
		switch pending := slices.Contains(pendingCodes, c); {
		case known[c] && pending:
			t.Errorf("%q is mapped now: remove it from pendingCodes", c)
		case !known[c] && !pending:
			t.Errorf("faregate/codes defines %q, which api/codes.go does not map", c)
		}
	}
	for _, c := range pendingCodes {
		if !slices.Contains(consts, c) {
			t.Errorf("pending %q is no constant of faregate/codes", c)
		}
	}
}

// readmeRowRE is a row of the README's error-code table: | 429 | `code` | …
var readmeRowRE = regexp.MustCompile("(?m)^\\| ([1-5][0-9][0-9]) \\| `([a-z0-9_]+)` \\|")

// TestREADMECodes: the README's table of error codes lists every code of
// the API's table with its status, and no other, and its paragraph on
// failed tasks and warnings names every task code and warning.
func TestREADMECodes(t *testing.T) {
	b, err := os.ReadFile("../cmd/faregate/README.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	start := strings.Index(doc, "## Error codes")
	end := strings.Index(doc[start+1:], "\n## ")
	if start < 0 || end < 0 {
		t.Fatal(`README.md has no "## Error codes" section`)
	}
	section := doc[start : start+1+end]
	rows := map[string]int{}
	for _, m := range readmeRowRE.FindAllStringSubmatch(section, -1) {
		st, _ := strconv.Atoi(m[1])
		if _, dup := rows[m[2]]; dup {
			t.Errorf("README lists %s twice", m[2])
		}
		rows[m[2]] = st
		if want, ok := api.CodeStatus(m[2]); !ok {
			t.Errorf("README lists %s, which api/codes.go does not know", m[2])
		} else if want != st {
			t.Errorf("README: %s is %d, the table answers %d", m[2], st, want)
		}
	}
	for _, c := range api.Codes() {
		if _, ok := rows[c]; !ok {
			t.Errorf("README's table lacks %s", c)
		}
	}
	for _, c := range append(api.TaskErrorCodes(), api.WarningCodes()...) {
		if !strings.Contains(section, "`"+c+"`") {
			t.Errorf("README's error codes section does not name %s", c)
		}
	}
}
