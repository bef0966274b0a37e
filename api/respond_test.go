package api

import (
	"net/http"
	"net/http/httptest"
	"testing"
)

// TestAnswersWithoutAServer: an answer written where no server is at hand
// comes from the one table all the same: writeJSON's own failure (a body
// that cannot be encoded).
func TestAnswersWithoutAServer(t *testing.T) {
	tests := []struct {
		name  string
		write func(w http.ResponseWriter)
		want  string
	}{
		{"writeJSON", func(w http.ResponseWriter) { writeJSON(w, http.StatusOK, map[string]any{"x": make(chan int)}) },
			`{"error":{"code":"internal_error","message":"Something went wrong on our side."}}` + "\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := httptest.NewRecorder()
			tt.write(rec)
			if rec.Code != http.StatusInternalServerError || rec.Body.String() != tt.want {
				t.Fatalf("%d %q, want 500 %q", rec.Code, rec.Body.String(), tt.want)
			}
			if ct := rec.Header().Get("Content-Type"); ct != "application/json; charset=utf-8" {
				t.Fatalf("Content-Type %q", ct)
			}
		})
	}
}
