package gateway

import (
	"strings"
	"testing"
)

// A member name a provider written in Go would read as another name
// (encoding/json matches names ignoring case, "K", "ſ", "ı" and "İ"
// included, and takes the last match) is refused with the member named,
// before the governor hears of the call: what is checked and counted is
// what every provider reads.
func TestCaseFoldedNames(t *testing.T) {
	up := okUpstream(t)
	e := newEnv(t, up.upstream(), nil)
	chat := `"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]`
	resp := `"model":"gpt-4o-mini","input":"hi"`
	cases := []struct{ name, path, body, param string }{
		{"model twice but for case", "/v1/chat/completions", `{` + chat + `,"MODEL":"gpt-5-pro"}`, "MODEL"},
		{"n in upper case", "/v1/chat/completions", `{` + chat + `,"N":5}`, "N"},
		{"max_tokens with a long s", "/v1/chat/completions", `{` + chat + `,"max_tokenſ":100000}`, "max_tokenſ"},
		{"max_tokens, then with a Kelvin sign", "/v1/chat/completions", `{` + chat + `,"max_tokens":10,"max_to\u212aens":100000}`, "max_to\u212aens"},
		{"stream in title case", "/v1/chat/completions", `{` + chat + `,"Stream":true}`, "Stream"},
		{"instructions with a dotless i", "/v1/responses", `{` + resp + `,"\u0131nstructions":"x"}`, "\u0131nstructions"},
		{"escaped upper-case name", "/v1/chat/completions", `{` + chat + `,"\u004e":2}`, "N"},
		{"include_usage in upper case", "/v1/chat/completions", `{` + chat + `,"stream":true,"stream_options":{"INCLUDE_USAGE":false}}`, "stream_options.INCLUDE_USAGE"},
		{"a message's content twice but for case", "/v1/chat/completions", `{"model":"gpt-4o-mini","messages":[{"role":"user","content":"a long text","Content":"hi"}]}`, "messages"},
		{"an escaped Content", "/v1/chat/completions", `{"model":"gpt-4o-mini","messages":[{"role":"user","\u0043ontent":"hi"}]}`, "messages"},
		{"a part's Text", "/v1/chat/completions", `{"model":"gpt-4o-mini","messages":[{"role":"user","content":[{"type":"text","text":"a","Text":"b"}]}]}`, "messages"},
		{"an input item's CONTENT", "/v1/responses", `{"model":"gpt-4o-mini","input":[{"role":"user","CONTENT":"hi"}]}`, "input"},
		{"a tool's Type", "/v1/chat/completions", `{` + chat + `,"tools":[{"type":"function","Type":"web_search","function":{"name":"f"}}]}`, "tools"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r, body := e.post(t, c.path, c.body)
			code, _, param := errorOf(t, body)
			if r.StatusCode != 400 || code != "invalid_request" || param != c.param {
				t.Fatalf("got %d %s %q, want 400 invalid_request %q (%s)", r.StatusCode, code, param, c.param, body)
			}
		})
	}
	if n := len(e.gov.specs); n != 0 {
		t.Fatalf("the governor heard of %d calls", n)
	}
	// What looks alike and is not a member name, or is one nobody folds
	// into a read name, passes: a name inside a string, vendor members,
	// camelCase JSON Schema keywords, a schema's own property names.
	for _, c := range []struct{ path, body string }{
		{"/v1/chat/completions", `{"model":"gpt-4o-mini","messages":[{"role":"user","content":"reply as {\"Content\": \"x\", \"N\": 5}"}]}`},
		{"/v1/chat/completions", `{` + chat + `,"topK":4,"vendor_kwargs":{"Enable":true}}`},
		{"/v1/chat/completions", `{` + chat + `,"tools":[{"type":"function","function":{"name":"f","strict":true,"parameters":{"type":"object","additionalProperties":false,"properties":{"City":{"type":"string"}},"required":["City"]}}}]}`},
		{"/v1/responses", `{` + resp + `,"tools":[{"type":"function","name":"f","parameters":{"type":"object","properties":{"Kind":{"anyOf":[{"type":"string"}]}}}}]}`},
		{"/v1/responses", `{"model":"gpt-4o-mini","input":[{"role":"user","content":[{"type":"input_text","text":"\"Text\": 1"}]}]}`},
	} {
		if r, b := e.post(t, c.path, c.body); r.StatusCode != 200 {
			t.Fatalf("%s: %d %s", c.body, r.StatusCode, b)
		}
	}
}

// Tools with two names in one object that fold alike are counted as their
// JSON too (both texts), beside the rendering by agent/tokens' structs
// (the last one).
func TestFoldTwinToolsCountBoth(t *testing.T) {
	long := strings.Repeat("Looks up the weather of a city by its name. ", 200)
	body := func(fn string) []byte {
		return []byte(`{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":` + fn + `}]}`)
	}
	twins, err := parseCall(KindChat, body(`{"name":"f","description":"`+long+`","Description":"x"}`), anyModel)
	if err != nil {
		t.Fatal(err)
	}
	honest, err := parseCall(KindChat, body(`{"name":"f","description":"`+long+`"}`), anyModel)
	if err != nil {
		t.Fatal(err)
	}
	if twins.prompt < honest.prompt {
		t.Fatalf("a description beside a Description counted %d, the description alone %d", twins.prompt, honest.prompt)
	}
	for _, c := range []struct {
		raw  string
		want bool
	}{
		{`[{"a":1,"A":2}]`, true},
		{`{"x":{"description":"d","DESCRIPTION":"e"}}`, true},
		{`{"x":{"a":1},"y":{"a":2}}`, false},
		{`[{"a":1},{"a":2}]`, false},
		{`{"a":"\"A\":","b":["A","a"]}`, false},
		{`{"\u0061":1,"A":2}`, true},
	} {
		if got := foldTwins([]byte(c.raw)); got != c.want {
			t.Errorf("foldTwins(%s) = %v, want %v", c.raw, got, c.want)
		}
	}
}

// AmbiguousName finds, at any depth, a repeated name, two names that fold
// alike, and a name a case-insensitive decoder reads as another; names
// inside strings and lower-case names pass.
func TestAmbiguousName(t *testing.T) {
	for _, c := range []struct {
		body, want string
	}{
		{`{"url":"a","url":"b"}`, "url"},
		{`{"URL":"a"}`, "URL"},
		{`{"name":"a","status":"ok","Name":"b"}`, "Name"},
		{`{"result":{"text":"a","text":"b"}}`, "text"},
		{`{"result":{"title":"t","text":"a","\u0054ext":"b"}}`, "Text"},
		{`{"max_byteſ":1}`, "max_byteſ"},
		{`{"url":"x","max_bytes":1,"detail":{"k":1,"k":2}}`, "k"},
		{`{"url":"{\"URL\":1}","max_bytes":1}`, ""},
		{`{"a":{"b":1},"c":{"b":2}}`, ""},
		{`[{"a":1},{"a":2}]`, ""},
	} {
		got, found := AmbiguousName([]byte(c.body))
		if got != c.want || found != (c.want != "") {
			t.Errorf("AmbiguousName(%s) = %q, %v; want %q", c.body, got, found, c.want)
		}
	}
}
