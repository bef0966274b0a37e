package gateway

import (
	"net/http"
	"strings"
	"testing"
)

// A usage report that does not say in numbers what was used (a string for
// a count, a count missing) is marked Unreadable, for the governor to
// charge as the manual says of an unparseable report; it is not taken
// for a missing report, which would be charged at the count alone. A
// readable one and a missing one are what they were.
func TestUnreadableUsage(t *testing.T) {
	cases := []struct {
		name, usage          string
		reported, unreadable bool
	}{
		{"readable", `{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15}`, true, false},
		{"missing", ``, false, false},
		{"null", `null`, false, false},
		{"a string for a count", `{"prompt_tokens":"many","completion_tokens":3}`, true, true},
		{"no output count", `{"prompt_tokens":12}`, true, true},
		{"not an object", `"lots"`, true, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			up := newScripted(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
				w.Header().Set("Content-Type", "application/json")
				body := `{"id":"c1","object":"chat.completion","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"Lisbon has seven hills."},"finish_reason":"stop"}]`
				if c.usage != "" {
					body += `,"usage":` + c.usage
				}
				_, _ = w.Write([]byte(body + "}"))
			})
			e := newEnv(t, up.upstream(), nil)
			resp, raw := e.post(t, "/v1/chat/completions", `{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Lisbon"}]}`)
			if resp.StatusCode != 200 || !strings.Contains(raw, "seven hills") {
				t.Fatalf("%d %s", resp.StatusCode, raw)
			}
			spec, _, out, _ := e.gov.last(t)
			u := out.Usage
			if u.Reported != c.reported || u.Unreadable != c.unreadable {
				t.Fatalf("usage %+v, want reported %v unreadable %v", u, c.reported, c.unreadable)
			}
			if c.unreadable && (u.Raw != c.usage || u.Prompt != spec.PromptTokens || u.Completion != out.Counted || out.Counted < 1) {
				t.Fatalf("unreadable usage %+v (counted %d, prompt %d): want the raw report beside the estimate", u, out.Counted, spec.PromptTokens)
			}
		})
	}
}
