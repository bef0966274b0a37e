package agent

import (
	"strings"

	"faregate/agent/task"
	"testing"
)

func TestParseAnswer(t *testing.T) {
	good := `{"summary":"S","days":[{"day":1,"title":"T","items":["a"," "]},{"day":2,"title":"U","items":["b"]}]}`
	cases := []struct {
		name, text string
		days       int
		ok         bool
	}{
		{"valid", good, 2, true},
		{"fenced with prose", "Here you go:\n```json\n" + good + "\n```", 2, true},
		{"wrong day count", good, 3, false},
		{"no summary", `{"days":[{"day":1,"title":"T","items":["a"]}]}`, 1, false},
		{"misnumbered", `{"summary":"S","days":[{"day":2,"title":"T","items":["a"]}]}`, 1, false},
		{"empty items", `{"summary":"S","days":[{"day":1,"title":"T","items":[" "]}]}`, 1, false},
		{"not json", "I cannot plan that.", 1, false},
		{"truncated", good[:40], 2, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, days, err := parseAnswer(tc.text, tc.days)
			if (err == nil) != tc.ok {
				t.Fatalf("err = %v, want ok=%v", err, tc.ok)
			}
			if tc.ok && len(days[0].Items) != 1 {
				t.Fatalf("blank items not dropped: %v", days[0].Items)
			}
		})
	}
}

func TestCanonicalArgs(t *testing.T) {
	same := []string{`{"location":"Lisbon","units":"c"}`, `{ "units":"c", "location" : "lisbon " }`}
	if canonicalArgs(same[0]) != canonicalArgs(same[1]) {
		t.Fatalf("%q != %q", canonicalArgs(same[0]), canonicalArgs(same[1]))
	}
	if canonicalArgs(`{"location":"Lisbon"}`) == canonicalArgs(`{"location":"Porto"}`) {
		t.Fatal("different arguments compare equal")
	}
}

// TestUserPromptNFKC: the model is given the visitor's text in NFKC, with
// its case (#19 item 7).
func TestUserPromptNFKC(t *testing.T) {
	got := userPrompt(task.Request{Destination: "ＬＩＳＢＯＮ", Days: 2, Interests: []string{"ﬁsh", "Sa\u0303o"}})
	if !strings.Contains(got, "Plan 2 day(s) in LISBON.") || !strings.Contains(got, "Interests: fish, São.") {
		t.Fatalf("userPrompt = %q", got)
	}
}
