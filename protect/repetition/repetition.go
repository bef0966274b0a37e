// Package repetition spots a model stuck in a loop while its answer streams,
// so the caller can cancel the call before it burns the rest of max_tokens.
//
// The measure is the share of repeated word n-grams in a sliding window of
// the most recent words: 1 − distinct/total n-grams. Prose, even an
// itinerary whose every day reads "Morning: … Afternoon: … Evening: …",
// repeats few 4-grams, because the names, places and verbs between the
// fixed phrases change; a model that emits the same sentence or the same
// JSON item over and over soon repeats nearly all of them. The default
// threshold 0.8 follows the repetition-ratio detectors in the literature on
// neural text degeneration.
//
// Words are runs of letters, digits and marks, case-folded; every
// all-digit word counts as the same word, so a model that keeps counting
// ("Day 8: Free day. Day 9: Free day. ...") is caught like any other loop.
// Han and kana characters are one word each, as those scripts use no spaces.
//
// Defaults: word 4-grams, a 200-word window, threshold 0.8, and no verdict
// before the window holds a quarter of its n-grams (50 words). A loop whose
// repeated unit is at most about 40 words (a fifth of the window) is caught;
// after prose has filled the window, a loop is caught within about
// 0.8 × 200 words plus one unit, around 250 tokens.
package repetition

import (
	"unicode"
	"unicode/utf8"
)

// Defaults used by New for arguments that are zero or out of range.
const (
	DefaultN         = 4
	DefaultWindow    = 200
	DefaultThreshold = 0.8
)

// FNV-1a constants: words and n-grams are kept as 64-bit hashes, so memory
// stays bounded whatever the text (a collision merely lowers the measured
// repetition by a hair, which errs on the side of not firing).
const (
	fnvOffset = 14695981039346656037
	fnvPrime  = 1099511628211
	// numberHash stands for any all-digit word.
	numberHash = fnvOffset ^ 0x4e554d
)

// Detector measures repetition in one stream. It is not safe for
// concurrent use: one detector per streamed answer.
type Detector struct {
	n         int
	threshold float64
	minGrams  int

	pending []byte // the start of a UTF-8 sequence split across chunks
	word    uint64 // running hash of the word being read
	inWord  bool
	digits  bool // the word so far is all digits

	recent []uint64 // the last n word hashes, as a ring
	words  int      // words seen so far

	grams  []uint64 // n-gram hashes in the window, as a ring
	next   int      // ring position of the next n-gram
	filled int      // n-grams currently in the window
	counts map[uint64]int32

	fired bool
}

// New returns a Detector over word n-grams in a window of the last window
// words that fires when the repeated share reaches threshold. Zero or
// invalid arguments take the defaults (n < 1, window ≤ 2n, threshold not in
// (0, 1]).
func New(n, window int, threshold float64) *Detector {
	if n < 1 {
		n = DefaultN
	}
	if window <= 2*n {
		window = max(DefaultWindow, 4*n)
	}
	if threshold <= 0 || threshold > 1 {
		threshold = DefaultThreshold
	}
	size := window - n + 1
	return &Detector{
		n:         n,
		threshold: threshold,
		minGrams:  max(size/4, 2),
		recent:    make([]uint64, n),
		grams:     make([]uint64, size),
		counts:    make(map[uint64]int32, size),
	}
}

// Write feeds the next chunk of streamed text and reports whether the
// stream is looping. Chunks may split words and UTF-8 sequences anywhere.
// Once it has reported a loop it keeps doing so: the caller is expected to
// cancel the call. A word still open at the end of a chunk is counted when
// the next chunk ends it.
func (d *Detector) Write(chunk []byte) (looping bool) {
	if len(d.pending) > 0 {
		// Finish the sequence split at the previous boundary. The pending
		// bytes (at most three) are decoded together with the first bytes
		// of this chunk; if they turn out invalid, each bad byte becomes
		// a RuneError (a separator) and decoding resumes after it.
		var arr [2 * utf8.UTFMax]byte
		tmp := append(append(arr[:0], d.pending...), chunk[:min(utf8.UTFMax, len(chunk))]...)
		off := 0
		for off < len(d.pending) {
			if !utf8.FullRune(tmp[off:]) {
				// Still incomplete: the whole chunk is in tmp.
				d.pending = append(d.pending[:0], tmp[off:]...)
				return d.fired
			}
			r, size := utf8.DecodeRune(tmp[off:])
			d.rune(r)
			off += size
		}
		chunk = chunk[off-len(d.pending):]
		d.pending = d.pending[:0]
	}
	for len(chunk) > 0 {
		if !utf8.FullRune(chunk) {
			d.pending = append(d.pending[:0], chunk...)
			break
		}
		r, size := utf8.DecodeRune(chunk)
		d.rune(r)
		chunk = chunk[size:]
	}
	return d.fired
}

// Ratio is the repeated share of n-grams in the window now, 0 when empty.
func (d *Detector) Ratio() float64 {
	if d.filled == 0 {
		return 0
	}
	return 1 - float64(len(d.counts))/float64(d.filled)
}

// rune advances the tokenizer by one character. Words are runs of letters
// and digits, case-folded; everything else separates them. Han, Hiragana
// and Katakana characters are words of their own, because those scripts
// put no spaces between words and a whole paragraph must not become one.
func (d *Detector) rune(r rune) {
	switch {
	case unicode.In(r, unicode.Han, unicode.Hiragana, unicode.Katakana):
		d.endWord()
		d.word, d.inWord, d.digits = fnvOffset, true, false
		d.mix(r)
		d.endWord()
	case unicode.IsLetter(r) || unicode.IsDigit(r) || unicode.IsMark(r):
		if !d.inWord {
			d.word, d.inWord, d.digits = fnvOffset, true, true
		}
		d.digits = d.digits && unicode.IsDigit(r)
		d.mix(unicode.ToLower(r))
	default:
		d.endWord()
	}
}

// mix folds one character into the running word hash.
func (d *Detector) mix(r rune) {
	var b [utf8.UTFMax]byte
	for _, c := range b[:utf8.EncodeRune(b[:], r)] {
		d.word = (d.word ^ uint64(c)) * fnvPrime
	}
}

// endWord closes the current word, if any, and slides the window when it
// completes an n-gram.
func (d *Detector) endWord() {
	if !d.inWord {
		return
	}
	d.inWord = false
	if d.digits {
		// Every number is the same word: a model counting on ("Day 8:
		// free day. Day 9: free day. ...") is looping all the same.
		d.word = numberHash
	}
	d.recent[d.words%d.n] = d.word
	d.words++
	if d.words < d.n {
		return
	}
	// Hash the last n words in order, oldest first.
	g := uint64(fnvOffset)
	for i := d.words - d.n; i < d.words; i++ {
		g = (g ^ d.recent[i%d.n]) * fnvPrime
	}
	if d.filled == len(d.grams) {
		old := d.grams[d.next]
		if d.counts[old]--; d.counts[old] == 0 {
			delete(d.counts, old)
		}
	} else {
		d.filled++
	}
	d.grams[d.next] = g
	d.next = (d.next + 1) % len(d.grams)
	d.counts[g]++
	if d.filled >= d.minGrams && d.Ratio() >= d.threshold {
		d.fired = true
	}
}
