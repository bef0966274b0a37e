package api

import (
	"errors"
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// plainText applies the contract's text rules to an agent's event text
// (a minimal form of them, kept here until the shared text package
// lands): it must be UTF-8 without control characters (but tab, newline
// and carriage return when multiline), format characters (Cf) or tag
// characters; it is trimmed and returned in its NFKC form, whose code
// points are counted against max.
func plainText(s string, max int, multiline bool) (string, error) {
	if !utf8.ValidString(s) {
		return "", errors.New("must be UTF-8 text")
	}
	n := norm.NFKC.String(strings.TrimSpace(s))
	for _, t := range []string{s, n} {
		for _, r := range t {
			switch {
			case multiline && (r == '\t' || r == '\n' || r == '\r'):
			case unicode.Is(unicode.Cc, r):
				return "", errors.New("must not contain control characters")
			case unicode.Is(unicode.Cf, r), r >= 0xE0000 && r <= 0xE007F:
				return "", errors.New("must not contain format or tag characters")
			}
		}
	}
	if utf8.RuneCountInString(n) > max {
		return "", fmt.Errorf("must be at most %d characters", max)
	}
	return n, nil
}
