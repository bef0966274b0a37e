package task

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestIDs(t *testing.T) {
	a, b := NewID(), NewID()
	if a == b || !ValidID(a) || !ValidID(b) {
		t.Fatalf("ids %q %q", a, b)
	}
	for _, bad := range []string{"", "t_", a[:33], a + "0", "x" + a[1:], strings.ToUpper(a), a[:33] + "g"} {
		if ValidID(bad) {
			t.Errorf("ValidID(%q) = true", bad)
		}
	}
}

func TestLangAndFinal(t *testing.T) {
	if (Request{}).Lang() != LangEnglish || (Request{Language: LangChinese}).Lang() != LangChinese {
		t.Fatal("Lang")
	}
	for status, final := range map[string]bool{StatusQueued: false, StatusRunning: false, StatusSucceeded: true, StatusFailed: true} {
		if (Task{Status: status}).Final() != final {
			t.Errorf("Final(%s) != %v", status, final)
		}
	}
	// The language is part of the stored request and of the result.
	raw, _ := json.Marshal(Task{Request: Request{Language: LangChinese}, Result: &Result{Language: LangChinese}})
	if strings.Count(string(raw), `"language":"zh-CN"`) != 2 {
		t.Fatalf("%s", raw)
	}
}
