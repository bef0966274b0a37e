package aitf

import (
	"math"
	"strings"
	"testing"
)

// FuzzScore checks that no body makes the scanner panic, that the score and
// every dimension stay in range, and that scoring is deterministic. The
// seeds run with every plain `go test`; `go test -fuzz=FuzzScore` explores.
func FuzzScore(f *testing.F) {
	seeds := []string{
		pageBody(1),
		`{"tool_call_id":"call_abc","content":"42"}`,
		`{"tool\u005fcall_id":"c","mode":"batch","recursion_depth":3}`,
		`{"metadata":{"confidence":0.9},"tool_calls":[{"id":"x","function":{"name":"f"}}]}`,
		`{"recursion_depth":1e99999,"context_window":-1e400,"temperature":0e999999}`,
		`{"a":"\\\\\\"}`,
		`{"\u00zz":1}`,
		`]]]}}}{{{[[[`,
		strings.Repeat("[", 300),
		strings.Repeat(`{"a":`, 100) + `{"tool_call_id":"x"`,
		"\x00\xff\"\\",
		`{"id":78901,"doc":"doc_78912"}`,
		string(agentBody(600)),
		``,
	}
	for _, s := range seeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		s1, v1 := Score(body)
		if math.IsNaN(s1) || s1 < 0 || s1 > 1 {
			t.Fatalf("score %v out of [0,1]", s1)
		}
		for d, x := range v1 {
			if math.IsNaN(x) || x < 0 || x > 1 {
				t.Fatalf("%s = %v out of [0,1]", Dimensions[d], x)
			}
		}
		if s2, v2 := Score(body); s2 != s1 || v2 != v1 {
			t.Fatalf("not deterministic: %v %s then %v %s", s1, v1, s2, v2)
		}
		r := scan(body)
		if id := r.toolID(body); len(id) > 4*maxToolID {
			t.Fatalf("tool call id of %d bytes", len(id))
		}
	})
}
