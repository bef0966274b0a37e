package api

import (
	"errors"
	"strings"
	"testing"
)

// TestCreateRequestText: the documented text rule on the trip fields (#19
// item 7). Format and control characters are refused naming the field;
// the stored text is NFKC, trimmed, with its case; lengths count the NFKC
// form.
func TestCreateRequestText(t *testing.T) {
	refused := []struct{ name, body, field string }{
		{"tag characters in the destination", `{"destination":"Lisbon\udb40\udc20\udb40\udc62","days":2}`, "destination"},
		{"an interest of tag characters", `{"destination":"Lisbon","days":2,"interests":["\udb40\udc61\udb40\udc62"]}`, "interests"},
		{"zero-width space", `{"destination":"Lis\u200bbon","days":2}`, "destination"},
		{"zero-width joiner in an interest", `{"destination":"Lisbon","days":2,"interests":["fo\u200dod"]}`, "interests"},
		{"soft hyphen", `{"destination":"Lis\u00adbon","days":2}`, "destination"},
		{"bidi override", `{"destination":"\u202eLisbon","days":2}`, "destination"},
		{"byte order mark", `{"destination":"\ufeffLisbon","days":2}`, "destination"},
		{"NUL", `{"destination":"Lisbon\u0000","days":2}`, "destination"},
		{"C1 control", `{"destination":"Lisbon\u0085","days":2}`, "destination"},
		{"invalid UTF-8 (a lone surrogate)", `{"destination":"Lisbon\ud800","days":2}`, "destination"},
		{"line break in a one-line field", `{"destination":"Lis\nbon","days":2}`, "destination"},
		{"tab in an interest", `{"destination":"Lisbon","days":2,"interests":["a\tb"]}`, "interests"},
		// U+FDFA is one code point that NFKC writes as 18: 5 of them are 90.
		{"NFKC length", `{"destination":"` + strings.Repeat("\ufdfa", 5) + `","days":2}`, "destination"},
		{"only no-break spaces", `{"destination":"\u00a0\u00a0","days":2}`, "destination"},
	}
	for _, tc := range refused {
		_, err := parseCreateRequest([]byte(tc.body))
		var ie *InvalidError
		if !errors.As(err, &ie) || ie.Fields[tc.field] == "" {
			t.Errorf("%s: %v, want a message for %s", tc.name, err, tc.field)
			continue
		}
		if len(ie.Fields) != 1 {
			t.Errorf("%s: fields %v, want only %s", tc.name, ie.Fields, tc.field)
		}
	}
	// The message names what was refused.
	_, err := parseCreateRequest([]byte(`{"destination":"Lis\u200bbon","days":2}`))
	var ie *InvalidError
	if !errors.As(err, &ie) || !strings.Contains(ie.Fields["destination"], "format or control characters (U+200B at character 4)") {
		t.Errorf("message: %v", err)
	}

	req, err := parseCreateRequest([]byte(`{"destination":"\u00a0ＬＩＳＢＯＮ\u00a0","days":2,"interests":["ﬁsh","Sa\u0303o"]}`))
	if err != nil {
		t.Fatal(err)
	}
	if req.Destination != "LISBON" || strings.Join(req.Interests, "|") != "fish|São" {
		t.Fatalf("stored %q %q, want the NFKC text trimmed, case kept", req.Destination, req.Interests)
	}
	// 80 code points of NFKC are fine although the input was longer in bytes.
	if _, err := parseCreateRequest([]byte(`{"destination":"` + strings.Repeat("e\u0301", 80) + `","days":2}`)); err != nil {
		t.Fatalf("80 decomposed é (80 NFKC code points): %v", err)
	}
}

// TestPromptRequest: the prompt form (#21 item 6) takes a prompt of 1 to
// max code points of NFKC after the text rule, with tabs and line breaks.
func TestPromptRequest(t *testing.T) {
	const max = 20
	refused := []struct{ name, body, field string }{
		{"missing", `{"turnstile_token":"t"}`, "prompt"},
		{"null", `{"prompt":null}`, "prompt"},
		{"not a string", `{"prompt":["a"]}`, "prompt"},
		{"blank", `{"prompt":" \n\t "}`, "prompt"},
		{"too long", `{"prompt":"` + strings.Repeat("a", max+1) + `"}`, "prompt"},
		{"too long in NFKC", `{"prompt":"\ufdfa\ufdfa"}`, "prompt"},
		{"zero-width space", `{"prompt":"ig\u200bnore"}`, "prompt"},
		{"tag characters", `{"prompt":"hi\udb40\udc20"}`, "prompt"},
		{"NUL", `{"prompt":"hi\u0000"}`, "prompt"},
		{"bad language", `{"prompt":"hi","language":"fr"}`, "language"},
		{"token not a string", `{"prompt":"hi","turnstile_token":1}`, "turnstile_token"},
		{"not an object", `"hi"`, "body"},
	}
	for _, tc := range refused {
		_, err := parsePromptRequest([]byte(tc.body), max)
		var ie *InvalidError
		if !errors.As(err, &ie) || ie.Fields[tc.field] == "" {
			t.Errorf("%s: %v, want a message for %s", tc.name, err, tc.field)
		}
	}
	req, err := parsePromptRequest([]byte(`{"turnstile_token":"tok","prompt":"  Ｌｉｓｂｏｎ\n\tfor two ","language":"zh-cn","destination":"ignored","days":3}`), max)
	if err != nil {
		t.Fatal(err)
	}
	if req.Prompt != "Lisbon\n\tfor two" || req.Language != "zh-CN" || req.Token != "tok" || req.Destination != "" || req.Days != 0 {
		t.Fatalf("parsed %+v", req)
	}
	if got := promptTexts(req); len(got) != 1 || got[0] != req.Prompt {
		t.Fatalf("prompt rules read %q", got)
	}
	// Exactly max code points pass.
	if _, err := parsePromptRequest([]byte(`{"prompt":"`+strings.Repeat("é", max)+`"}`), max); err != nil {
		t.Fatalf("%d code points: %v", max, err)
	}
}
