package task

import (
	"encoding/json"
	"strings"
	"testing"
)

// TestParseAnswer: an agent's answer is one object with a result (text
// of 1 byte to 64 KiB of UTF-8, an optional one-line plain title) or an
// error with a code; anything else is refused with a reason.
func TestParseAnswer(t *testing.T) {
	good := []string{
		`{"result":{"text":"# Hi"}}`,
		`{"result":{"text":"hi","title":" A title "}}`,
		`{"result":{"text":"` + strings.Repeat("a", MaxResultText) + `"}}`,
		`{"result":{"text":"emoji 👩‍💻 keeps its joiner"}}`,
		`{"error":{"code":"x","message":"why"}}`,
	}
	for _, b := range good {
		if _, err := ParseAnswer([]byte(b)); err != nil {
			t.Errorf("%.60s: %v", b, err)
		}
	}
	a, _ := ParseAnswer([]byte(good[1]))
	if *a.Result.Title != "A title" {
		t.Errorf("title %q, want it trimmed", *a.Result.Title)
	}
	bad := []string{
		``, `[]`, `{}`, `{"result":{"text":""}}`, `{"result":{"text":"  "}}`, `{"result":{"text":1}}`,
		`{"result":{"text":"` + strings.Repeat("a", MaxResultText+1) + `"}}`,
		`{"result":{"text":"ok","title":"a\nb"}}`, `{"result":{"text":"ok","title":"a\u200bb"}}`,
		`{"result":{"text":"ok","title":"` + strings.Repeat("t", 201) + `"}}`,
		`{"error":{"message":"no code"}}`, `{"result":{"text":"a"},"error":{"code":"x"}}`,
		`{"result":{"text":"a"}} {"result":{"text":"b"}}`,
	}
	for _, b := range bad {
		if _, err := ParseAnswer([]byte(b)); err == nil {
			t.Errorf("%.60q accepted", b)
		}
	}
}

// TestResultShapes: a plan keeps its shape; an agent's text result has
// the documented {"text","title"?,"warnings","model","language"}.
func TestResultShapes(t *testing.T) {
	plan, _ := json.Marshal(Result{Summary: "s", Days: []Day{{Day: 1, Title: "t", Items: []string{"i"}}}, Warnings: []string{}, Model: "m", Language: "en"})
	if string(plan) != `{"summary":"s","days":[{"day":1,"title":"t","items":["i"]}],"warnings":[],"model":"m","offline":false,"language":"en"}` {
		t.Errorf("plan %s", plan)
	}
	text, _ := json.Marshal(Result{Text: "# x", Model: "m", Language: "zh-CN"})
	if string(text) != `{"text":"# x","warnings":[],"model":"m","language":"zh-CN"}` {
		t.Errorf("text %s", text)
	}
	var back Result
	if err := json.Unmarshal(text, &back); err != nil || back.Text != "# x" || back.Language != "zh-CN" {
		t.Errorf("round trip %+v %v", back, err)
	}
}
