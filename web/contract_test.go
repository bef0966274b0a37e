package web_test

import (
	"io/fs"
	"regexp"
	"slices"
	"testing"

	"faregate/api"
	"faregate/api/apitest"
	"faregate/web"
)

var (
	// `export type ErrorCode = | 'a' // comment | 'b';` in client.d.ts.
	unionRE   = regexp.MustCompile(`(?s)export type (\w+) =(.*?);[ \t]*(?://[^\n]*)?\n`)
	memberRE  = regexp.MustCompile(`'([A-Za-z0-9_-]+)'`)
	commentRE = regexp.MustCompile(`//[^\n]*`)
)

// unions reads the string-literal unions of client.d.ts by name.
func unions(t *testing.T) map[string][]string {
	t.Helper()
	src, err := fs.ReadFile(web.Files(), "client.d.ts")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]string{}
	for _, m := range unionRE.FindAllSubmatch(src, -1) {
		var members []string
		for _, q := range memberRE.FindAllSubmatch(commentRE.ReplaceAll(m[2], nil), -1) {
			members = append(members, string(q[1]))
		}
		out[string(m[1])] = members
	}
	return out
}

// TestContractCodes: client.d.ts's unions name exactly the codes of the
// API's table (api/codes.go), so a code added there fails here until the
// client's types follow, and a type names no code the server cannot send.
// The page's messages are checked against the same table in
// web_test.go's TestMessageTables.
func TestContractCodes(t *testing.T) {
	v, err := apitest.NewValidator()
	if err != nil {
		t.Fatal(err)
	}
	src, err := fs.ReadFile(web.Files(), "messages.js")
	if err != nil {
		t.Fatal(err)
	}
	tables, err := web.ParseTables(src)
	if err != nil {
		t.Fatal(err)
	}
	types := unions(t)
	tests := []struct {
		union, prefix string
		want          []string
	}{
		{"ErrorCode", "err.", api.Codes()},
		{"TaskErrorCode", "taskerr.", api.TaskErrorCodes()},
		{"WarningCode", "warn.", api.WarningCodes()},
		{"Language", "lang.name.", v.Enum("Language")},
	}
	for _, tc := range tests {
		t.Run(tc.union, func(t *testing.T) {
			want := slices.Sorted(slices.Values(tc.want))
			ts := slices.Sorted(slices.Values(types[tc.union]))
			if len(want) == 0 || !slices.Equal(want, ts) {
				t.Errorf("api/codes.go %v\nclient.d.ts %s %v", want, tc.union, ts)
			}
			for _, code := range want {
				for lang, table := range tables {
					if table[tc.prefix+code] == "" {
						t.Errorf("%s table has no %s%s", lang, tc.prefix, code)
					}
				}
			}
		})
	}
	// The client's own codes never shadow a server's.
	for _, c := range types["ClientErrorCode"] {
		if slices.Contains(api.Codes(), c) {
			t.Errorf("ClientErrorCode %q is also a server code", c)
		}
	}
}

// stepKindsRE is the page's list of the step kinds it renders.
var stepKindsRE = regexp.MustCompile(`const STEP_KINDS = \[([^\]]*)\]`)

// TestStepKindsRendered: the page renders every step kind the document
// names as it renders the planner's (an external agent's "agent" steps
// among them): each is in app.js's STEP_KINDS, so it is neither shown as
// "unknown" nor left without its label in either language.
func TestStepKindsRendered(t *testing.T) {
	v, err := apitest.NewValidator()
	if err != nil {
		t.Fatal(err)
	}
	src, err := fs.ReadFile(web.Files(), "app.js")
	if err != nil {
		t.Fatal(err)
	}
	m := stepKindsRE.FindSubmatch(src)
	if m == nil {
		t.Fatal("no STEP_KINDS in app.js")
	}
	var page []string
	for _, q := range memberRE.FindAllSubmatch(m[1], -1) {
		page = append(page, string(q[1]))
	}
	msgs, err := fs.ReadFile(web.Files(), "messages.js")
	if err != nil {
		t.Fatal(err)
	}
	tables, err := web.ParseTables(msgs)
	if err != nil {
		t.Fatal(err)
	}
	doc := v.Enum("StepKind")
	if !slices.Contains(doc, "agent") {
		t.Fatalf("StepKind %v lacks agent", doc)
	}
	for _, kind := range doc {
		if !slices.Contains(page, kind) {
			t.Errorf("app.js STEP_KINDS %v lacks %q: its steps would show as unknown", page, kind)
		}
		for lang, table := range tables {
			if table["step.kind."+kind] == "" {
				t.Errorf("%s table has no step.kind.%s", lang, kind)
			}
		}
	}
}
