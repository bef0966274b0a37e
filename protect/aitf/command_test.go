package aitf

import (
	"bytes"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"
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

// session renders NDJSON session lines for visitor v: one per body, the
// i-th at t0 plus step×i.
func session(v string, t0 time.Time, step time.Duration, bodies ...string) string {
	var b strings.Builder
	for i, body := range bodies {
		fmt.Fprintf(&b, `{"visitor":%q,"at":%q,"body":%s}`+"\n", v, t0.Add(time.Duration(i)*step).Format(time.RFC3339Nano), body)
	}
	return b.String()
}

// field returns the value of name= in an output line, or -1.
func field(t *testing.T, line, name string) float64 {
	t.Helper()
	for _, f := range strings.Fields(line) {
		if v, ok := strings.CutPrefix(f, name+"="); ok {
			x, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatalf("%s in %q: %v", name, line, err)
			}
			return x
		}
	}
	t.Fatalf("no %s in %q", name, line)
	return -1
}

func TestScoreCommandSessions(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 10, 0, 0, 0, time.UTC)
	distinct := func(n int) []string {
		out := make([]string, n)
		for i := range out {
			out[i] = fmt.Sprintf(`{"q":"lisbon %d"}`, i)
		}
		return out
	}
	docs := []string{`{"doc_id":"doc_78901"}`, `{"doc_id":"doc_78903"}`, `{"doc_id":"doc_78907"}`, `{"doc_id":"doc_78910"}`, `{"doc_id":"doc_78912"}`}
	same := []string{`{"q":"x"}`, `{"q":"x"}`, `{"q":"x"}`, `{"q":"x"}`, `{"q":"x"}`}
	tests := []struct {
		name  string
		in    string
		lines int
		dim   string // dimension checked on the last line
		want  float64
	}{
		{"burst of 12 in a second", session("v1", t0, 50*time.Millisecond, distinct(12)...), 12, "burst", 1},
		{"12 spread over a minute", session("v1", t0, 5*time.Second, distinct(12)...), 12, "burst", 0},
		{"enumeration of doc ids", session("v1", t0, 2*time.Second, docs...), 5, "enumeration", 1},
		{"the same body five times", session("v1", t0, 10*time.Second, same...), 5, "repeat", 1},
		{"the same body once a minute", session("v1", t0, 61*time.Second, same...), 5, "repeat", 0},
		{"enumeration through the path", `{"visitor":"v1","at":"2026-01-01T10:00:00Z","body":null,"path":"/api/docs/doc_78901"}` + "\n" +
			`{"visitor":"v1","at":"2026-01-01T10:00:02Z","body":null,"path":"/api/docs/doc_78902"}` + "\n", 2, "enumeration", 0.25},
		{"a body captured as a string", session("v1", t0, time.Second, `"{\"tool_call_id\":\"call_1\"}"`), 1, "toolcall", 1},
		{"visitors are apart", session("v1", t0, 2*time.Second, docs[0], docs[2]) + session("v2", t0.Add(time.Second), 2*time.Second, docs[1], docs[3]), 4, "enumeration", 0.25},
		{"plain body lines between session lines", session("v1", t0, 10*time.Second, same[:2]...) + toolBody + "\n" + session("v1", t0.Add(20*time.Second), 10*time.Second, same[:1]...), 4, "repeat", 0.5},
		{"a plain body has no behaviour", toolBody + "\n" + toolBody + "\n" + toolBody + "\n", 3, "repeat", 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			if err := ScoreCommand(strings.NewReader(tc.in), &out); err != nil {
				t.Fatalf("ScoreCommand: %v", err)
			}
			lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
			if len(lines) != tc.lines {
				t.Fatalf("%d lines, want %d:\n%s", len(lines), tc.lines, out.String())
			}
			for _, l := range lines {
				if s := field(t, l, "score"); !strings.HasPrefix(l, "score=") || s < 0 || s > 1 {
					t.Errorf("line %q does not start with a score in [0,1]", l)
				}
			}
			if got := field(t, lines[len(lines)-1], tc.dim); got != tc.want {
				t.Errorf("%s = %.2f on the last line, want %.2f:\n%s", tc.dim, got, tc.want, out.String())
			}
		})
	}
	t.Run("a bad time is an error", func(t *testing.T) {
		err := ScoreCommand(strings.NewReader(`{"visitor":"v1","at":"yesterday","body":{}}`+"\n"), &bytes.Buffer{})
		if !errors.Is(err, ErrSessionLine) || !strings.Contains(err.Error(), "1") {
			t.Errorf("err = %v, want ErrSessionLine naming line 1", err)
		}
	})
}
