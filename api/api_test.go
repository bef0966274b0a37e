package api

import (
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

func TestParseCreateRequest(t *testing.T) {
	cases := []struct {
		name, body string
		field      string // "" = valid
	}{
		{"valid", `{"turnstile_token":"t","destination":"Lisbon","days":3,"interests":["food"]}`, ""},
		{"unknown fields ignored", `{"destination":"Rome","days":1,"extra":{"a":[1,2]}}`, ""},
		{"null interests", `{"destination":"Rome","days":1,"interests":null}`, ""},
		{"80 code points", `{"destination":"` + strings.Repeat("ö", 80) + `","days":7}`, ""},
		{"81 code points", `{"destination":"` + strings.Repeat("ö", 81) + `","days":7}`, "destination"},
		{"control character", `{"destination":"Rome\u0007","days":1}`, "destination"},
		{"days float", `{"destination":"Rome","days":1.0}`, "days"},
		{"days exponent", `{"destination":"Rome","days":1e0}`, "days"},
		{"days string", `{"destination":"Rome","days":"1"}`, "days"},
		{"days bool", `{"destination":"Rome","days":true}`, "days"},
		{"interests object", `{"destination":"Rome","days":1,"interests":{"a":1}}`, "interests"},
		{"interest 33", `{"destination":"Rome","days":1,"interests":["` + strings.Repeat("a", 33) + `"]}`, "interests"},
		{"not an object", `"Rome"`, "body"},
		{"null", `null`, "body"},
		{"two objects", `{} {}`, "body"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, bad := parseCreateRequest([]byte(tc.body))
			switch {
			case tc.field == "" && bad != nil:
				t.Fatalf("refused: %+v", bad)
			case tc.field != "" && (bad == nil || bad.fields[tc.field] == ""):
				t.Fatalf("want a message for %q, got %+v", tc.field, bad)
			}
		})
	}
}

func TestWriteErrorRetryAfter(t *testing.T) {
	cases := []struct {
		code  string
		retry time.Duration
		want  string
	}{
		{CodeIPLimit, 5*time.Hour + 12*time.Minute, "18720"},
		{CodeProtectionDown, 0, "5"},
		{CodeProtectionDown, 2 * time.Minute, "30"}, // 503s suggest at most 30 s
		{CodeAITFQueueFull, 1500 * time.Millisecond, "2"},
		{CodeInvalidRequest, time.Hour, ""},
	}
	for _, tc := range cases {
		w := httptest.NewRecorder()
		writeError(w, httptest.NewRequest("GET", "/", nil), tc.code, tc.retry, nil)
		if got := w.Header().Get("Retry-After"); got != tc.want {
			t.Errorf("%s: Retry-After %q, want %q", tc.code, got, tc.want)
		}
		if w.Code != errorTable[tc.code].status || !strings.Contains(w.Body.String(), `"code":"`+tc.code+`"`) {
			t.Errorf("%s: %d %s", tc.code, w.Code, w.Body.String())
		}
	}
}

func TestValidStreamID(t *testing.T) {
	for s, want := range map[string]bool{"1700000000000-0": true, "1-2": true, "0": true, "": false, "-1": false, "1-": false, "1-2-3": false, "abc": false} {
		if validStreamID(s) != want {
			t.Errorf("validStreamID(%q) = %v", s, !want)
		}
	}
}

func TestRequestIDTrust(t *testing.T) {
	h := requestIDs(nil, discard(), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	r := httptest.NewRequest("GET", "/", nil)
	r.Header.Set("X-Request-Id", "from-client")
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	if got := w.Header().Get("X-Request-Id"); got == "from-client" || len(got) != 24 {
		t.Fatalf("untrusted client id kept: %q", got)
	}
}

func discard() *slog.Logger { return slog.New(slog.DiscardHandler) }
