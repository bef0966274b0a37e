package canon

import (
	"strings"
	"unicode"

	"golang.org/x/text/unicode/norm"
)

// Skeleton returns the form of s that the built-in prompt rules match on,
// in the spirit of a UTS #39 skeleton but fitted to regular expressions
// written in ASCII and Han:
//
//  1. Fold (NFKC, case-folded);
//  2. canonical decomposition, and every combining mark dropped, so
//     "ìgnörе" reads "ignore";
//  3. a letter that only looks like one or two ASCII letters or digits is
//     written as them (the confusable table: Cyrillic "о" → "o", Greek
//     "ι" → "i", "ɡ" → "g"). ASCII itself is never rewritten: the full
//     UTS #39 skeleton maps "m" to "rn" and "1" to "l", which no pattern
//     written for readable text could match;
//  4. any whitespace becomes one space, and Forbidden characters (which
//     Check refuses, but a caller may not have checked) are dropped;
//  5. NFC, so Hangul and the like are whole again.
//
// Han characters pass unchanged. Skeleton is for matching only: never shown
// to anyone, never given to the model.
func Skeleton(s string) string {
	s = norm.NFD.String(Fold(s))
	var b strings.Builder
	b.Grow(len(s))
	space := false
	for _, r := range s {
		switch {
		case r < 0x80 && r > 0x20 && r != 0x7f:
			b.WriteByte(byte(r))
		case unicode.IsSpace(r):
			if !space {
				b.WriteByte(' ')
			}
			space = true
			continue
		case Forbidden(r), unicode.Is(unicode.Mn, r):
			// Dropped without ending a run of spaces.
			continue
		default:
			if to, ok := confusable[r]; ok {
				b.WriteString(to)
			} else {
				b.WriteRune(r)
			}
		}
		space = false
	}
	return norm.NFC.String(b.String())
}
