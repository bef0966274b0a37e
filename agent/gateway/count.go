package gateway

import (
	"unicode/utf8"

	"faregate/agent/tokens"
)

// outCounter counts the output tokens that pass through a stream, in
// constant memory.
//
// For models whose tokenizer agent/tokens knows (the OpenAI families) the
// text is counted with that tokenizer over a short window: BPE merges never
// cross a pre-token boundary, and a space followed by a letter always
// starts a pre-token in cl100k_base and o200k_base (" word"), so the text
// before the last such boundary is counted once and committed, and only
// the window after it is recounted as pieces arrive. Counting each piece on
// its own instead would count "hello " as two tokens where the text's
// " hello" is one, and cut honest streams at half their limit. A window
// that finds no boundary within windowMax bytes (text without spaces) is
// committed where it stands, which can only count a token more.
//
// For other models it is agent/tokens' conservative bound, computed
// incrementally: the same rules over the same character runs, with a run
// that continues into the next piece continuing here too, so the count of a
// stream equals tokens.Counter{}.Count of its whole text (a test checks it)
// rather than rounding every piece up.
type outCounter struct {
	enc  tokens.Counter // Known(): windowed counting
	kind byte           // of the last Part
	done int64          // tokens of finished runs, before the final quarter
	// the open run: its class and length; nonASCII bytes are summed apart
	// as bound does.
	class    byte
	run      int64
	firstSp  bool // the open space run started with ' '
	nonASCII int64
	// known tokenizer: tokens committed, the open window and its count.
	committed int64
	window    []byte
	winTokens int64
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

// Part counts a piece of one kind of output (content, reasoning, a tool
// call's name, its arguments, …): a piece of another kind than the last
// is a separate text, which no token spans.
func (c *outCounter) Part(kind byte, s string) {
	if kind != c.kind {
		c.kind = kind
		c.cut()
	}
	c.Add(s)
}

// cut ends the text so far: nothing later merges with it.
func (c *outCounter) cut() {
	if c.enc.Known() {
		if len(c.window) > 0 {
			c.committed += c.winTokens
			c.window, c.winTokens = c.window[:0], 0
		}
		return
	}
	c.close()
}

// Add counts a piece of output text.
func (c *outCounter) Add(s string) {
	if s == "" {
		return
	}
	if c.enc.Known() {
		c.addKnown(s)
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

// windowMax bounds the recounted window: it is committed at its last
// boundary whenever it has one (the window is then one word or so: the
// tokenizer's cost grows with what it is given), and anywhere past
// windowMax.
const windowMax = 1024

func (c *outCounter) addKnown(s string) {
	c.window = append(c.window, s...)
	{
		k := -1
		for i := len(c.window) - 2; i > 0; i-- {
			if c.window[i] == ' ' && isASCIILetter(c.window[i+1]) {
				k = i
				break
			}
		}
		if k < 0 && len(c.window) > windowMax {
			k = len(c.window)
		}
		if k > 0 {
			c.committed += c.enc.Count(string(c.window[:k]))
			n := copy(c.window, c.window[k:])
			c.window = c.window[:n]
			if cap(c.window) > 4*windowMax {
				c.window = append([]byte(nil), c.window...) // a huge piece must not pin memory
			}
		}
	}
	c.winTokens = c.enc.Count(string(c.window))
}

func isASCIILetter(b byte) bool { return b|0x20 >= 'a' && b|0x20 <= 'z' }

// Tokens is the count so far.
func (c *outCounter) Tokens() int64 {
	if c.enc.Known() {
		return c.committed + c.winTokens
	}
	d := *c
	d.close()
	n := d.done + (d.nonASCII+1)/2
	return n + (n+3)/4
}
