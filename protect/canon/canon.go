// Package canon is the one canonical form of the text visitors and agents
// send: which characters are refused, what the model is given, and what
// rules and caches compare. It has no dependency beyond golang.org/x/text.
//
// The four steps, in the order a request goes through them:
//
//   - Check refuses text holding invisible characters that change what a
//     model reads without changing what a person sees: format characters
//     (Unicode category Cf: zero-width spaces and joiners, bidirectional
//     controls, soft hyphens, the tag block U+E0000–U+E007F), control
//     characters (Cc) other than tab, newline and carriage return, and
//     bytes that are not UTF-8 (or U+FFFD, which is what a JSON decoder
//     made of them). The api answers 400 invalid_request naming the field.
//   - NFKC is the text the model is given and the text lengths are counted
//     on: compatibility forms written plainly (full-width letters, a
//     no-break space, ligatures), not case-folded.
//   - Fold is the form text is compared on: NFKC and case-folded, so
//     "LISBON", "Lisbon" and "ｌｉｓｂｏｎ" are one text.
//   - Skeleton is the form the built-in prompt rules match on: Fold, then
//     accents dropped, letters that only look like ASCII (Cyrillic "о",
//     Greek "ι", IPA "ɡ") written as the ASCII they imitate (UTS #39
//     confusables), every kind of whitespace one space. It is for matching
//     only; nothing is shown or stored in it.
//
// Check(s) == nil implies Check(NFKC(s)) == nil, and Fold and Skeleton are
// idempotent (FuzzCanon).
package canon

import (
	"fmt"
	"unicode"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// Error is Check's refusal: Field names the request field, Rune the first
// refused character and Index its position in code points (0-based).
type Error struct {
	Field string
	Rune  rune
	Index int
	// Invalid is set when the text was not UTF-8 at Index; Rune is then
	// utf8.RuneError.
	Invalid bool
}

func (e *Error) Error() string { return e.Field + " " + e.Message() }

// Message says what is wrong without the field's name, for an API that
// reports a message per field.
func (e *Error) Message() string {
	if e.Invalid {
		return fmt.Sprintf("must be valid UTF-8 text (character %d is not)", e.Index+1)
	}
	return fmt.Sprintf("must not contain format or control characters (%U at character %d)", e.Rune, e.Index+1)
}

// Forbidden reports whether r is refused in request text: a format
// character, a control character other than \t, \n and \r, anything in the
// tag block (assigned or not), or U+FFFD.
func Forbidden(r rune) bool {
	switch {
	case r == '\t' || r == '\n' || r == '\r':
		return false
	case r < 0x20 || r == 0x7f:
		return true
	case r < 0x80:
		return false
	case r >= 0xE0000 && r <= 0xE007F, r == utf8.RuneError:
		return true
	}
	return unicode.Is(unicode.Cc, r) || unicode.Is(unicode.Cf, r)
}

// Check returns an *Error naming field when s holds a Forbidden character
// or is not valid UTF-8, else nil.
func Check(field, s string) error {
	i := 0
	for off := 0; off < len(s); i++ {
		r, size := utf8.DecodeRuneInString(s[off:])
		if r == utf8.RuneError && size <= 1 {
			return &Error{Field: field, Rune: r, Index: i, Invalid: true}
		}
		if Forbidden(r) {
			return &Error{Field: field, Rune: r, Index: i}
		}
		off += size
	}
	return nil
}

// NFKC returns s in Unicode normalisation form KC: the text the model is
// given and whose code points a length limit counts. Letter case is kept.
func NFKC(s string) string { return norm.NFKC.String(s) }

// Len is the length of s in code points of its NFKC form, the length the
// documented limits are stated in.
func Len(s string) int { return utf8.RuneCountInString(NFKC(s)) }
