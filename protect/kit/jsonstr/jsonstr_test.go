package jsonstr

import (
	"bytes"
	"encoding/json"
	"testing"
)

// stdlib is encoding/json's string encoding with HTML escaping off: what
// Append must write.
func stdlib(s string) string {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(s)
	return string(bytes.TrimSuffix(b.Bytes(), []byte("\n")))
}

func TestAppend(t *testing.T) {
	tests := []struct{ name, in, want string }{
		{"plain", "gpt-4o-mini", `"gpt-4o-mini"`},
		{"empty", "", `""`},
		{"quote and backslash", `a"b\c`, `"a\"b\\c"`},
		{"short escapes", "\b\f\n\r\t", `"\b\f\n\r\t"`},
		{"other controls", "\x00\x1f\x7f", `"\u0000\u001f` + "\x7f" + `"`},
		{"html stays", "<a&b>", `"<a&b>"`},
		{"unicode stays", "Zürich 東京 🙂", `"Zürich 東京 🙂"`},
		{"separators", "a\u2028b\u2029c", `"a\u2028b\u2029c"`},
		{"invalid utf-8", "a\xffb\xc3", `"a\ufffdb\ufffd"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := string(Append([]byte("x"), tt.in))
			if got != "x"+tt.want {
				t.Errorf("Append(%q) = %s, want %s", tt.in, got[1:], tt.want)
			}
			if q := Quote(tt.in); q != tt.want || q != stdlib(tt.in) {
				t.Errorf("Quote(%q) = %s; want %s, encoding/json writes %s", tt.in, q, tt.want, stdlib(tt.in))
			}
		})
	}
}

// TestAppendAllocates: appending into room already there allocates
// nothing, escaped or not.
func TestAppendAllocates(t *testing.T) {
	buf := make([]byte, 0, 256)
	for _, s := range []string{"gpt-4o-mini", "line\nbreak \"quoted\" \xff"} {
		if n := testing.AllocsPerRun(100, func() { buf = Append(buf[:0], s) }); n != 0 {
			t.Errorf("Append(%q) allocates %v times", s, n)
		}
	}
}

// FuzzAppend: whatever the string, Append writes encoding/json's bytes.
func FuzzAppend(f *testing.F) {
	for _, s := range []string{"", "plain", "a\"b\\c\n", "\x00\x1f\u2028\xff\xe2\x80", "東京🙂<&>"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if got, want := Quote(s), stdlib(s); got != want {
			t.Fatalf("Quote(%q) = %s, encoding/json writes %s", s, got, want)
		}
	})
}
