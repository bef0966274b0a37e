package api

import (
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"faregate/protect/canon"
)

// plainText applies the documented text rules (protect/canon) to an
// agent's event text: no format, control or tag characters (tab, newline
// and carriage return only when multiline), returned trimmed in its NFKC
// form, whose code points are counted against max.
func plainText(s string, max int, multiline bool) (string, error) {
	if err := canon.Check("", s); err != nil {
		var ce *canon.Error
		if errors.As(err, &ce) {
			return "", errors.New(ce.Message())
		}
		return "", err
	}
	n := canon.NFKC(strings.TrimSpace(s))
	if !multiline && strings.ContainsAny(n, "\t\n\r") {
		return "", errors.New("must be one line, without tabs")
	}
	if err := canon.Check("", n); err != nil {
		return "", errors.New("must not contain format or control characters")
	}
	if utf8.RuneCountInString(n) > max {
		return "", fmt.Errorf("must be at most %d characters", max)
	}
	return n, nil
}
