package guide

import (
	"strings"
	"unicode"
)

// foldTable maps lower-case Latin letters with diacritics to their ASCII
// base, so "São", "Sao" and "SÃO" meet in one token. The standard library
// has no Unicode decomposition, and golang.org/x/text is not a dependency;
// the letters below cover the languages of the corpus and of its visitors.
// It is a constant table, never written after initialisation.
var foldTable = func() map[rune]string {
	groups := map[string]string{
		"a": "àáâãäåāăąǎ", "c": "çćĉċč", "d": "ďđð", "e": "èéêëēĕėęě",
		"g": "ĝğġģ", "h": "ĥħ", "i": "ìíîïĩīĭįı", "j": "ĵ", "k": "ķ",
		"l": "ĺļľŀł", "n": "ñńņňŉ", "o": "òóôõöøōŏő", "r": "ŕŗř",
		"s": "śŝşšș", "t": "ţťŧț", "u": "ùúûüũūŭůűų", "w": "ŵ", "y": "ýÿŷ",
		"z": "źżž", "ss": "ß", "ae": "æ", "oe": "œ", "th": "þ",
	}
	m := make(map[rune]string)
	for base, letters := range groups {
		for _, r := range letters {
			m[r] = base
		}
	}
	return m
}()

// isCJK reports scripts written without spaces between words. Their runs
// are indexed as overlapping character pairs, so "东京天气" (Tokyo weather)
// still meets the alias "东京".
func isCJK(r rune) bool {
	return unicode.In(r, unicode.Han, unicode.Hiragana, unicode.Katakana) || r == 'ー' || r == '々'
}

// appendFolded lowercases r and strips its accent.
func appendFolded(b *strings.Builder, r rune) {
	r = unicode.ToLower(r)
	if f, ok := foldTable[r]; ok {
		b.WriteString(f)
		return
	}
	b.WriteRune(r)
}

// tokenize splits text into search terms: lower case, accents folded,
// letters and digits only, CJK runs as character bigrams.
func tokenize(s string) []string {
	var out []string
	var word strings.Builder
	var cjk []rune
	flushWord := func() {
		if word.Len() > 0 {
			out = append(out, word.String())
			word.Reset()
		}
	}
	flushCJK := func() {
		switch {
		case len(cjk) == 1:
			out = append(out, string(cjk))
		case len(cjk) > 1:
			for i := 0; i+1 < len(cjk); i++ {
				out = append(out, string(cjk[i:i+2]))
			}
		}
		cjk = cjk[:0]
	}
	for _, r := range s {
		switch {
		case unicode.Is(unicode.Mn, r):
			// A combining accent (decomposed input, Thai vowel signs) is
			// dropped without breaking the word it belongs to.
		case isCJK(r):
			flushWord()
			cjk = append(cjk, r)
		case unicode.IsLetter(r) || unicode.IsDigit(r):
			flushCJK()
			appendFolded(&word, r)
		default:
			flushWord()
			flushCJK()
		}
	}
	flushWord()
	flushCJK()
	return out
}

// normalize reduces a place name to a lookup key: folded lower case words
// separated by single spaces, punctuation dropped. CJK names stay whole.
func normalize(s string) string {
	var b strings.Builder
	space := false
	for _, r := range s {
		switch {
		case unicode.Is(unicode.Mn, r):
		case unicode.IsLetter(r) || unicode.IsDigit(r):
			if space && b.Len() > 0 {
				b.WriteByte(' ')
			}
			space = false
			appendFolded(&b, r)
		default:
			space = true
		}
	}
	return b.String()
}
