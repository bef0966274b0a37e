package plancache

import (
	"encoding/json"
	"reflect"
	"regexp"
	"testing"

	"golang.org/x/text/unicode/norm"

	"faregate/protect/canon"
)

func TestKeyFormat(t *testing.T) {
	k := Key(Request{Destination: "Zürich", Days: 3})
	if !regexp.MustCompile(`^faregate:plan:\{[0-9a-f]{64}\}$`).MatchString(k) {
		t.Fatalf("key %q is not faregate:plan:{<sha256 hex>}", k)
	}
}

func TestNormalizeText(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want string
	}{
		{"trim and case", "  ZÜRICH ", "zurich"},
		{"accent", "Zürich", "zurich"},
		{"decomposed accent", "Zu\u0308rich", "zurich"},
		{"full-width letters", "ＺＵＲＩＣＨ", "zurich"},
		{"tilde and inner whitespace", "São \t\n Paulo", "sao paulo"},
		{"acute", "Kraków", "krakow"},
		{"stroke letters", "Łódź", "lodz"},
		{"dotted capital I", "İstanbul", "istanbul"},
		{"dotless i", "Diyarbakır", "diyarbakir"},
		{"sharp s", "Straße", "strasse"},
		{"capital sharp s", "GIEẞEN", "giessen"},
		{"ligature", "ﬁrenze", "firenze"},
		{"no-break space", "New\u00a0York", "new york"},
		// Invisible characters are part of the text the model reads: kept,
		// so they never share a plain text's key.
		{"zero-width space and soft hyphen kept", "Zü\u200bri\u00adch", "zu\u200bri\u00adch"},
		{"tag characters kept", "Lisbon\U000E0020\U000E0069", "lisbon\U000E0020\U000E0069"},
		{"control characters kept", "Zur\x00ich\x7f", "zur\x00ich\x7f"},
		{"greek tonos and capitals", "ΑΘΉΝΑ", "αθηνα"},
		{"han unchanged", " 北京 ", "北京"},
		{"kana keeps its dakuten", "がっこう", "がっこう"},
		{"half-width katakana composes", "ｶﾞｲﾄﾞ", "ガイド"},
		{"hangul stays composed", norm.NFD.String("서울"), "서울"},
		{"cyrillic case folds", "МОСКВА", "москва"},
		{"cherokee capital", "Ꮴ", "ꮴ"},
		{"cherokee small", "ꮴ", "ꮴ"},
		{"cyrillic short i keeps its breve", "Мой", "мой"},
		{"invalid utf-8", "Zur\xffich", "zur\ufffdich"},
		{"blank", " \t ", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := normalizeText(tt.in); got != tt.want {
				t.Fatalf("normalizeText(%q) = %q, want %q", tt.in, got, tt.want)
			}
		})
	}
}

func TestNormalizeLanguage(t *testing.T) {
	tests := []struct{ in, want string }{
		{"", "en"},
		{"  ", "en"},
		{"en", "en"},
		{"EN", "en"},
		{"zh-cn", "zh-CN"},
		{"ZH-CN", "zh-CN"},
		{"zh_CN", "zh-CN"},
		{"zh-hant-tw", "zh-Hant-TW"},
		{"es-419", "es-419"},
		{"en-US-x-TWAIN", "en-US-x-twain"},
		{"X-PRIV-AB", "x-priv-ab"},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			if got := normalizeLanguage(tt.in); got != tt.want {
				t.Fatalf("normalizeLanguage(%q) = %q, want %q", tt.in, got, tt.want)
			}
		})
	}
}

func TestKeyEqual(t *testing.T) {
	base := Request{Destination: "Zürich", Days: 3, Interests: []string{"food", "museums"}, Language: "en"}
	tests := []struct {
		name string
		req  Request
	}{
		{"padded capitals", Request{Destination: "  ZÜRICH ", Days: 3, Interests: []string{"food", "museums"}, Language: "en"}},
		{"no accent", Request{Destination: "zurich", Days: 3, Interests: []string{"food", "museums"}, Language: "en"}},
		{"interest order", Request{Destination: "Zürich", Days: 3, Interests: []string{"museums", "food"}, Language: "en"}},
		{"interest duplicates and case", Request{Destination: "Zürich", Days: 3, Interests: []string{"Museums", "food", "FOOD", " museums "}, Language: "en"}},
		{"blank interests", Request{Destination: "Zürich", Days: 3, Interests: []string{"food", "", "  ", "museums"}, Language: "en"}},
		{"language omitted", Request{Destination: "Zürich", Days: 3, Interests: []string{"food", "museums"}}},
		{"language upper case", Request{Destination: "Zürich", Days: 3, Interests: []string{"food", "museums"}, Language: "EN"}},
	}
	want := Key(base)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Key(tt.req); got != want {
				t.Fatalf("Key(%+v) = %s, want the key of %+v (%s)", tt.req, got, base, want)
			}
		})
	}
	if Key(Request{Destination: "x", Interests: nil}) != Key(Request{Destination: "x", Interests: []string{}}) {
		t.Fatal("nil and empty interests must share a key")
	}
	if Key(Request{Destination: "x", Language: "zh-cn"}) != Key(Request{Destination: "x", Language: "zh-CN"}) {
		t.Fatal("zh-cn and zh-CN must share a key")
	}
}

func TestKeyDiffers(t *testing.T) {
	base := Request{Destination: "Zürich", Days: 3, Interests: []string{"food", "museums"}, Language: "en"}
	tests := []struct {
		name string
		req  Request
	}{
		{"destination", Request{Destination: "Bern", Days: 3, Interests: []string{"food", "museums"}, Language: "en"}},
		{"days", Request{Destination: "Zürich", Days: 4, Interests: []string{"food", "museums"}, Language: "en"}},
		{"an interest fewer", Request{Destination: "Zürich", Days: 3, Interests: []string{"food"}, Language: "en"}},
		{"another interest", Request{Destination: "Zürich", Days: 3, Interests: []string{"food", "hiking"}, Language: "en"}},
		{"language", Request{Destination: "Zürich", Days: 3, Interests: []string{"food", "museums"}, Language: "zh-CN"}},
		{"words joined", Request{Destination: "Zu rich", Days: 3, Interests: []string{"food", "museums"}, Language: "en"}},
		// #19 item 7: hidden instructions in tag characters, and an interest
		// made only of them, are not the plain request.
		{"tag characters", Request{Destination: "Zürich\U000E0020\U000E0062\U000E0065", Days: 3, Interests: []string{"food", "museums"}, Language: "en"}},
		{"an interest of tag characters", Request{Destination: "Zürich", Days: 3, Interests: []string{"food", "museums", "\U000E0061\U000E0062"}, Language: "en"}},
		{"zero-width space", Request{Destination: "Zü\u200brich", Days: 3, Interests: []string{"food", "museums"}, Language: "en"}},
	}
	want := Key(base)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Key(tt.req); got == want {
				t.Fatalf("Key(%+v) equals the key of %+v", tt.req, base)
			}
		})
	}
}

// TestKeyKeepsNonLatinMarks checks that dropping accents never merges two
// different words of a script whose marks are part of the spelling.
func TestKeyKeepsNonLatinMarks(t *testing.T) {
	pairs := [][2]string{
		{"がっこう", "かっこう"}, // school, cuckoo: only the dakuten differs
		{"Мой", "Мои"},
		{"ภูเก็ต", "ภเกต"}, // Phuket, and the same letters without Thai vowel signs
	}
	for _, p := range pairs {
		if Key(Request{Destination: p[0]}) == Key(Request{Destination: p[1]}) {
			t.Errorf("%q and %q share a key", p[0], p[1])
		}
	}
}

// TestCanonicalInjective shows why field text can never move a field
// boundary: requests that a naive separator-joined form would confuse get
// different keys, and the canonical JSON decodes back to exactly the
// canonical value it encodes, so two different canonical values can never
// encode to the same bytes.
func TestCanonicalInjective(t *testing.T) {
	pairs := []struct {
		name string
		a, b Request
	}{
		{"comma in destination vs interest",
			Request{Destination: "a,b", Days: 1},
			Request{Destination: "a", Days: 1, Interests: []string{"b"}}},
		{"comma in interest vs two interests",
			Request{Destination: "x", Days: 1, Interests: []string{"a,b"}},
			Request{Destination: "x", Days: 1, Interests: []string{"a", "b"}}},
		{"pipe and digits vs days",
			Request{Destination: "x|1", Days: 2},
			Request{Destination: "x", Days: 12}},
		{"JSON syntax in destination",
			Request{Destination: `a","interests":["b`, Days: 1},
			Request{Destination: "a", Days: 1, Interests: []string{"b"}}},
		{"language text in interest",
			Request{Destination: "x", Days: 1, Interests: []string{`a"],"language":"zh-CN`}},
			Request{Destination: "x", Days: 1, Interests: []string{"a"}, Language: "zh-CN"}},
	}
	for _, p := range pairs {
		t.Run(p.name, func(t *testing.T) {
			if Key(p.a) == Key(p.b) {
				t.Fatalf("%+v and %+v share a key", p.a, p.b)
			}
			for _, req := range []Request{p.a, p.b} {
				var back canonical
				if err := json.Unmarshal(canonicalJSON(req), &back); err != nil {
					t.Fatal(err)
				}
				if want := canonicalize(req); !reflect.DeepEqual(back, want) {
					t.Fatalf("canonical JSON decodes to %+v, want %+v", back, want)
				}
			}
		})
	}
}

// FuzzNormalizeText checks that the canonical text is a fixed point (a
// second normalisation changes nothing, so a stored key is reached again
// from its own canonical form) and that the canonical JSON of any request
// decodes back to the canonical value.
func FuzzNormalizeText(f *testing.F) {
	for _, s := range []string{"  ZÜRICH ", "São Paulo", "İstanbul", "ｶﾞｲﾄﾞ", "서울", "ΑΘΉΝΑ", "Zu\u00ad\u0308rich", "\xff", "ﬃ"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		n := normalizeText(s)
		if again := normalizeText(n); again != n {
			t.Fatalf("normalizeText(%q) = %q, but normalizeText(%q) = %q", s, n, n, again)
		}
		// A coarsening of canon.Fold: the folded text shares the key.
		if f := normalizeText(canon.Fold(s)); f != n {
			t.Fatalf("normalizeText(%q) = %q, but of its canon.Fold %q", s, n, f)
		}
		req := Request{Destination: s, Days: 2, Interests: []string{s, "x"}, Language: s}
		var back canonical
		if err := json.Unmarshal(canonicalJSON(req), &back); err != nil {
			t.Fatal(err)
		}
		if want := canonicalize(req); !reflect.DeepEqual(back, want) {
			t.Fatalf("canonical JSON decodes to %+v, want %+v", back, want)
		}
	})
}
