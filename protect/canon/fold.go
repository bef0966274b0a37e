package canon

import (
	"strings"
	"unicode"

	"golang.org/x/text/unicode/norm"
)

// Fold returns s in NFKC and case-folded: the form on which two texts are
// the same text. Invalid UTF-8 becomes U+FFFD first.
//
// Case folding is per rune, lower(upper(r)), with ß and ẞ written "ss",
// rather than golang.org/x/text/cases: its Fold maps Cherokee small
// letters to capitals and capitals to small letters, so folding twice
// gives back the first spelling and two spellings of one word would never
// compare equal. lower(upper(r)) picks one member of every case pair; the
// full folding's other expansions (ligatures, "ŉ", "ǰ") are done by NFKC.
// Folding can leave text that NFKC writes differently (a lower-case letter
// that composes with a following mark), so the two alternate until nothing
// changes; that takes at most one more round on any text found so far, and
// the bound keeps hostile input from looping. The result is a fixed point
// (FuzzCanon).
func Fold(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	for range 4 {
		next := foldRunes(norm.NFKC.String(s))
		if next == s {
			break
		}
		s = next
	}
	return s
}

// foldRunes case-folds s rune by rune.
func foldRunes(s string) string {
	var b strings.Builder
	b.Grow(len(s))
	for _, r := range s {
		switch {
		case r < 0x80:
			if 'A' <= r && r <= 'Z' {
				r += 'a' - 'A'
			}
			b.WriteByte(byte(r))
		case r == 'ß' || r == 'ẞ':
			b.WriteString("ss")
		default:
			b.WriteRune(unicode.ToLower(unicode.ToUpper(r)))
		}
	}
	return b.String()
}
