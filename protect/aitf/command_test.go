package aitf

import (
	"bytes"
	"errors"
	"strings"
	"testing"
)

func TestScoreCommand(t *testing.T) {
	tests := []struct {
		name      string
		in        string
		wantLines int
		wantFirst string // a fragment of the first line
	}{
		{"one body", toolBody, 1, "toolcall=1.00"},
		{"pretty-printed body is one body", "{\n  \"tool_call_id\": \"c\",\n  \"mode\": \"batch\"\n}\n", 1, "noninteractive=1.00"},
		{"ndjson", toolBody + "\n" + pageBody(1) + "\n\n" + `{"recursion_depth":3}` + "\n", 3, "toolcall=1.00"},
		{"a line that is not JSON is scored", "{\"tool_call_id\":\"c\"\nnot json at all\n", 2, "toolcall=1.00"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			if err := ScoreCommand(strings.NewReader(tc.in), &out); err != nil {
				t.Fatalf("ScoreCommand: %v", err)
			}
			lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
			if len(lines) != tc.wantLines {
				t.Fatalf("%d lines, want %d:\n%s", len(lines), tc.wantLines, out.String())
			}
			if !strings.Contains(lines[0], tc.wantFirst) {
				t.Errorf("first line %q lacks %q", lines[0], tc.wantFirst)
			}
			for _, l := range lines {
				if !strings.HasPrefix(l, "score=") || strings.Count(l, "=") != dimCount+1 {
					t.Errorf("line %q: want score and %d named dimensions", l, dimCount)
				}
			}
		})
	}
}

func TestScoreCommandErrors(t *testing.T) {
	boom := errors.New("disk on fire")
	tests := []struct {
		name string
		in   *strings.Reader
		err  error
		want error
	}{
		{"empty input", strings.NewReader(""), nil, ErrNoInput},
		{"blank input", strings.NewReader(" \n\n"), nil, ErrNoInput},
		{"unreadable input", nil, boom, boom},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var err error
			if tc.in != nil {
				err = ScoreCommand(tc.in, &bytes.Buffer{})
			} else {
				err = ScoreCommand(errorReader{tc.err}, &bytes.Buffer{})
			}
			if !errors.Is(err, tc.want) {
				t.Errorf("err = %v, want %v", err, tc.want)
			}
		})
	}
}
