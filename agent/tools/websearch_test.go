package tools

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"faregate/protect/codes"
)

func TestWebSearch(t *testing.T) {
	var results []string
	for i := 1; i <= 7; i++ {
		results = append(results, fmt.Sprintf(`{"title":"Result %d\n title","url":"https://example.org/%d","content":"snippet %d"}`, i, i, i))
	}
	// A result with a non-web URL is skipped, not shown to the model.
	results[0] = `{"title":"Bad","url":"javascript:alert(1)","content":"x"}`
	body := `{"query":"lisbon","results":[` + strings.Join(results, ",") + `]}`

	down := downURL(t)
	var gotQ, gotFormat, gotPreset string
	tests := []struct {
		name        string
		handler     http.HandlerFunc
		url         string // overrides the server URL when set
		wantFailed  bool
		wantWarning string
		want        []string
		notWant     []string
	}{
		{
			name: "happy",
			handler: func(w http.ResponseWriter, r *http.Request) {
				gotQ, gotFormat, gotPreset = r.URL.Query().Get("q"), r.URL.Query().Get("format"), r.URL.Query().Get("language")
				io.WriteString(w, body)
			},
			want:    []string{`Web results for "lisbon events"`, "1. Result 2 title\n   https://example.org/2\n   snippet 2", "5. Result 6 title"},
			notWant: []string{"javascript:", "Result 7", "6."},
		},
		{
			name:    "no results",
			handler: func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, `{"results":[]}`) },
			want:    []string{`No web results for "lisbon events".`},
		},
		{
			name:       "server error",
			handler:    func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusInternalServerError) },
			wantFailed: true, wantWarning: codes.SearchUnavailable, want: []string{"Web search is unavailable"},
		},
		{
			name:       "not JSON",
			handler:    func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "<html>captcha</html>") },
			wantFailed: true, wantWarning: codes.SearchUnavailable,
		},
		{name: "server down", url: down, wantFailed: true, wantWarning: codes.SearchUnavailable},
		{name: "not configured", url: "-", wantFailed: true, wantWarning: codes.SearchUnavailable},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			u := tc.url
			if tc.handler != nil {
				srv, _ := serve(t, tc.handler)
				// An existing query parameter of the configured URL is kept.
				u = srv.URL + "/search?language=en"
			}
			if u == "-" {
				u = ""
			}
			sess, _ := session(t, nil)
			obs := NewWebSearch(sess.Client(), Config{SearchURL: u}).Call(context.Background(), args("query", "lisbon events"))
			if obs.Failed != tc.wantFailed || obs.Warning != tc.wantWarning {
				t.Fatalf("observation %+v", obs)
			}
			for _, w := range tc.want {
				if !strings.Contains(obs.Text, w) {
					t.Errorf("text lacks %q:\n%s", w, obs.Text)
				}
			}
			for _, w := range tc.notWant {
				if strings.Contains(obs.Text, w) {
					t.Errorf("text has %q:\n%s", w, obs.Text)
				}
			}
		})
	}
	if gotQ != "lisbon events" || gotFormat != "json" || gotPreset != "en" {
		t.Errorf("query q=%q format=%q language=%q", gotQ, gotFormat, gotPreset)
	}
}
