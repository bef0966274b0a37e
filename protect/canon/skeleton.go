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
//  1. a tag character (U+E0020–U+E007E) becomes the ASCII character it
//     shadows, as a model reads it ("ASCII smuggling"); then Fold (NFKC,
//     case-folded);
//  2. canonical decomposition, and every combining mark dropped, so
//     "ìgnörе" reads "ignore";
//  3. a letter that only looks like one or two ASCII letters or digits is
//     written as them (the confusable table: Cyrillic "о" → "o", Greek
//     "ι" → "i", "ɡ" → "g"). ASCII itself is never rewritten: the full
//     UTS #39 skeleton maps "m" to "rn" and "1" to "l", which no pattern
//     written for readable text could match;
//  4. a run of whitespace becomes one line break if it holds one (\n, \r,
//     U+2028 and the like), else one space, and Forbidden characters
//     (which Check refuses, but a caller may not have checked) are dropped;
//  5. NFC, so Hangul and the like are whole again.
//
// Han characters pass unchanged. Skeleton is for matching only: never shown
// to anyone, never given to the model.
func Skeleton(s string) string {
	s = norm.NFD.String(Fold(strings.Map(untag, s)))
	var b strings.Builder
	b.Grow(len(s))
	// pending is the whitespace run not yet written: 0 none, ' ' or '\n'.
	var pending byte
	for _, r := range s {
		switch {
		case isLineBreak(r):
			pending = '\n'
			continue
		case unicode.IsSpace(r):
			if pending == 0 {
				pending = ' '
			}
			continue
		case Forbidden(r) || unicode.Is(unicode.Mn, r):
			// Dropped without ending a run of whitespace.
			continue
		}
		if pending != 0 {
			b.WriteByte(pending)
			pending = 0
		}
		if to, ok := confusable[r]; ok {
			b.WriteString(to)
		} else {
			b.WriteRune(r)
		}
	}
	if pending != 0 {
		b.WriteByte(pending)
	}
	return norm.NFC.String(b.String())
}

// isLineBreak reports whether r ends a line: \n, \r, vertical tab, form
// feed, next line, and the line and paragraph separators.
func isLineBreak(r rune) bool {
	switch r {
	case '\n', '\r', '\v', '\f', 0x85, 0x2028, 0x2029:
		return true
	}
	return false
}

// untag maps a tag character to the ASCII character it shadows.
func untag(r rune) rune {
	if 0xE0020 <= r && r <= 0xE007E {
		return r - 0xE0000
	}
	return r
}
