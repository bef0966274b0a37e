package gateway

import (
	"unicode/utf8"

	"faregate/agent/tokens"
)

// outCounter counts the output tokens that pass through a stream, in
// constant memory.
//
// For models whose tokenizer agent/tokens knows (the OpenAI families) each
// piece is counted with that tokenizer as it arrives. Providers stream whole
// tokens per event, so the sum over pieces is the count of the text, or a
// little above it where a merge across two events was missed: the safe side.
//
// For other models it is agent/tokens' conservative bound, computed
// incrementally: the same rules over the same character runs, with a run
// that continues into the next piece continuing here too, so the count of a
// stream equals tokens.Counter{}.Count of its whole text (a test checks it)
// rather than rounding every piece up.
type outCounter struct {
	enc  tokens.Counter // Known(): per-piece counting
	done int64          // tokens of finished runs, before the final quarter
	// the open run: its class and length; nonASCII bytes are summed apart
	// as bound does.
	class    byte
	run      int64
	firstSp  bool // the open space run started with ' '
	nonASCII int64
	pieces   int64 // per-piece total (known tokenizer)
}

const (
	clNone byte = iota
	clLetter
	clDigit
	clSpace
	clPunct
)

func newOutCounter(model string) *outCounter {
	return &outCounter{enc: tokens.ForModel(model)}
}

// Add counts a piece of output text.
func (c *outCounter) Add(s string) {
	if s == "" {
		return
	}
	if c.enc.Known() {
		c.pieces += c.enc.Count(s)
		return
	}
	for i := 0; i < len(s); i++ {
		b := s[i]
		if b >= utf8.RuneSelf {
			// bound sums every byte of a code point (and every
			// invalid byte) apart, and such a byte ends a run.
			c.close()
			c.nonASCII++
			continue
		}
		var cl byte
		switch {
		case b|0x20 >= 'a' && b|0x20 <= 'z':
			cl = clLetter
		case b >= '0' && b <= '9':
			cl = clDigit
		case b == ' ' || b == '\n' || b == '\t' || b == '\r' || b == '\f' || b == '\v':
			cl = clSpace
		default:
			cl = clPunct
		}
		if cl != c.class {
			c.close()
			c.class, c.firstSp = cl, b == ' '
		}
		c.run++
	}
}

// close ends the open run, adding its cost as bound would.
func (c *outCounter) close() {
	switch c.class {
	case clLetter:
		c.done += (c.run + 3) / 4
	case clDigit:
		c.done += c.run
	case clSpace:
		if c.run > 1 || !c.firstSp {
			c.done += 1 + c.run/8
		}
	case clPunct:
		c.done += (c.run + 1) / 2
	}
	c.class, c.run = clNone, 0
}

// Tokens is the count so far.
func (c *outCounter) Tokens() int64 {
	if c.enc.Known() {
		return c.pieces
	}
	d := *c
	d.close()
	n := d.done + (d.nonASCII+1)/2
	return n + (n+3)/4
}
