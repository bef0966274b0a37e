package api

import (
	"net/http"
	"strings"
	"testing"

	"faregate/protect/codes"
)

// TestPlainText: an agent's event text follows the text rules: control,
// format and tag characters refused (tabs and newlines only where lines
// are allowed), NFKC form returned and counted.
func TestPlainText(t *testing.T) {
	cases := []struct {
		in        string
		max       int
		multiline bool
		want      string
		bad       bool
	}{
		{"  search  ", 64, false, "search", false},
		{"ﬁnd", 4, false, "find", false},      // NFKC: the ligature is two letters
		{"ﬁnd", 3, false, "", true},           // and counted as two
		{"a\u200bb", 64, false, "", true},     // zero-width space (Cf)
		{"a\u202eb", 64, false, "", true},     // bidi override (Cf)
		{"a\U000E0041b", 64, false, "", true}, // tag character
		{"a\x00b", 64, true, "", true},
		{"line\nline", 64, false, "", true},
		{"line\nline\tx", 64, true, "line\nline\tx", false},
		{strings.Repeat("é", 500), 500, true, strings.Repeat("é", 500), false},
		{strings.Repeat("e\u0301", 500), 500, true, strings.Repeat("é", 500), false}, // composed by NFKC
		{strings.Repeat("x", 65), 64, false, "", true},
		{"\xff", 64, false, "", true},
	}
	for _, c := range cases {
		got, err := plainText(c.in, c.max, c.multiline)
		if (err != nil) != c.bad || got != c.want {
			t.Errorf("plainText(%q, %d, %v) = %q, %v", c.in, c.max, c.multiline, got, err)
		}
	}
}

// TestV1Type: the OpenAI error type of each kind of answer.
func TestV1Type(t *testing.T) {
	for _, c := range []struct {
		status int
		code   string
		want   string
	}{
		{400, codes.FetchRefused, "invalid_request_error"},
		{404, codes.NotFound, "invalid_request_error"},
		{413, codes.RequestTooLarge, "invalid_request_error"},
		{401, codes.InvalidAPIKey, "authentication_error"},
		{429, codes.ToolLimit, "insufficient_quota"},
		{429, codes.EventLimit, "insufficient_quota"},
		{429, codes.DemoBudgetExhausted, "insufficient_quota"},
		{429, codes.TokenRateLimited, "rate_limit_error"},
		{http.StatusServiceUnavailable, codes.DemoProtectionUnavailable, "api_error"},
	} {
		if got := v1Type(c.status, c.code); got != c.want {
			t.Errorf("%d %s: %s, want %s", c.status, c.code, got, c.want)
		}
	}
}
