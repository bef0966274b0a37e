package aitf

import (
	"bytes"
	"encoding/binary"
	"math"
	"math/bits"
	"strings"
)

// This file freezes the scanner as it was before the speed work of issue
// 20's third round (commit f1466f9): a copy of scan.go's pass, renamed, with
// its key lookup rebuilt from vocabulary as a map rather than the generated
// switch. TestScanMatchesReference and FuzzScanMatchesReference hold the
// live scanner to give exactly its results on every body. The value rules
// (contribution, settled) are shared, not copied: the speed work does not
// touch them.

// refKeys is vocabulary as a map, numbered as keys_gen_test.go numbers it.
var refKeys = func() map[string]keySpec {
	m := map[string]keySpec{}
	next := kFirstOther
	for _, g := range vocabulary {
		id := g.id
		if id == kNone {
			id, next = next, next+1
		}
		for _, n := range strings.Fields(g.names) {
			m[n] = keySpec{id: id, dim: g.dim, rule: g.rule, w: g.w}
		}
	}
	return m
}()

func refLookupKey(b []byte) keySpec { return refKeys[string(b)] }

// The frozen bounds (see scan.go).
const (
	refMaxTracked = 1 << 12
	refMaxParents = 64
	refMaxKeyRaw  = 6 * 24
)

// refScanner is the frozen scanner's state.
type refScanner struct {
	scanner                            // out, seen, contribution and settled, which the speed work leaves alone
	objects [refMaxTracked / 64]uint64 // bit set: the container at that depth is an object
	parents [refMaxParents]uint8       // key id that opened the container at that depth
	memo    *[refMemoSize]refMemoKey   // keys met in this body; nil for short bodies
}

// refMemoSize is how many distinct keys a body's memo holds; agent bodies
// repeat a dozen keys in every message of their history.
const refMemoSize = 32

// refMemoMin is the body size from which the memo pays for itself: a short
// body repeats few keys, and clearing the memo costs more than it saves.
const refMemoMin = 4 << 10

// refMemoKey is a key met earlier in the body, as its offset and length there,
// and what refKeyOf made of it.
type refMemoKey struct {
	off   int
	n     uint8 // at most refMaxKeyRaw
	idKey bool
	spec  keySpec
}

// key is refKeyOf with a memo: a key written byte for byte as one met earlier
// in the body is not normalised and looked up again.
func (s *refScanner) key(b []byte, off int, raw []byte) (keySpec, bool) {
	n := len(raw)
	if n == 0 || n > refMaxKeyRaw {
		return refKeyOf(raw)
	}
	m := &s.memo[(n+int(raw[0])+int(raw[n-1])<<1)%refMemoSize]
	if int(m.n) == n && string(b[m.off:m.off+n]) == string(raw) {
		return m.spec, m.idKey
	}
	spec, idKey := refKeyOf(raw)
	*m = refMemoKey{off: off, n: uint8(n), idKey: idKey, spec: spec}
	return spec, idKey
}

// refScan reads body once and returns the body dimensions, the tool call id's
// position and the first enumeration candidate.
func refScan(body []byte) scanResult { return refScanMemo(body, len(body) >= refMemoMin) }

// refScanMemo is refScan with the key memo on or off (the memo must not change
// the result; a test holds it to that).
func refScanMemo(body []byte, useMemo bool) scanResult {
	var s refScanner
	if useMemo {
		// Declared here, the memo is zeroed only for the bodies that use it.
		var memo [refMemoSize]refMemoKey
		s.memo = &memo
	}
	s.run(body)
	return s.scanner.out
}

// run is the single pass. It never recurses and never looks back more than
// a string's trailing backslashes, so any input, valid or not, costs O(n).
func (s *refScanner) run(b []byte) {
	var (
		depth     int
		inObj     bool    // the innermost container is an object
		expectKey bool    // the next string is a key (in an object, after '{', ',' or a value)
		pend      keySpec // the known key waiting for its value (id 0 once settled)
		pendKey   uint8   // the waiting key's id even when settled: the parent of the container it opens
		pendIDKey bool    // the waiting key ends in "id": a numeric value may be enumerated
		pendRaw   []byte  // the waiting key as written; its hash is the enumeration prefix for numbers
		i         int     // read position
	)
	for i < len(b) {
		switch c := b[i]; c {
		case ' ', '\t', '\n', '\r', ':':
			i++
			continue
		case '"':
			// Most keys and ids close within their first eight bytes;
			// that case is checked here, inline, the rest in refStringEnd.
			end := -1
			if i+9 <= len(b) {
				if m := refQuoteBytes(binary.LittleEndian.Uint64(b[i+1:])); m == 0 {
					// No quote in the first eight bytes: search on from there.
					end = refStringEndAfter(b, i+1, i+9)
				} else if q := i + 1 + bits.TrailingZeros64(m)/8; b[q-1] != '\\' {
					end = q
				}
			}
			if end < 0 {
				end = refStringEnd(b, i+1)
			}
			raw := b[i+1 : end]
			if expectKey {
				if s.memo != nil {
					pend, pendIDKey = s.key(b, i+1, raw)
				} else {
					pend, pendIDKey = refKeyOf(raw)
				}
				pendKey = pend.id
				if pend.id != kNone && s.settled(pend) {
					// Nothing left for this key to add: its value is
					// skipped as an unknown key's is.
					pend.id = kNone
				}
				pendRaw = raw
				expectKey = false
				i = end + 1
				if i < len(b) && b[i] == ':' {
					i++ // the usual colon, without another trip round the loop
				}
				continue
			}
			if pend.id != kNone {
				v := value{kind: vString, raw: raw, off: i + 1}
				if len(raw) > 0 && len(raw) < 32 && (raw[0] == '-' || isDigit(raw[0])) {
					if n, j := refParseNumber(raw, 0); j == len(raw) {
						v.num, v.isNum = n, true
					}
				}
				s.apply(pend, s.parent(depth), v)
			}
			if !s.out.enum.ok && len(raw) >= 4 && len(raw) <= 48 {
				s.out.enum = enumOf(raw)
			}
			i = end + 1
		case '{', '[':
			kind := vArray
			if c == '{' {
				kind = vObject
			}
			var parent uint8
			if pend.id != kNone {
				s.apply(pend, s.parent(depth), value{kind: kind, empty: refEmptyContainer(b, i+1)})
			}
			if pendKey != kNone {
				parent = pendKey
			} else if depth > 0 && !inObj {
				// Elements of an array belong to the array's key, so
				// tool_calls[0].function is still inside tool_calls.
				parent = s.parent(depth)
			}
			depth++
			inObj = kind == vObject && depth < refMaxTracked
			if depth < refMaxTracked {
				bit := uint64(1) << (depth % 64)
				if inObj {
					s.objects[depth/64] |= bit
				} else {
					s.objects[depth/64] &^= bit
				}
			}
			if depth < refMaxParents {
				s.parents[depth] = parent
			}
			expectKey = inObj
			pend, pendKey, pendIDKey = keySpec{}, kNone, false
			i++
			continue
		case '}', ']':
			// Unbalanced closers in garbage must not drive depth negative.
			if depth > 0 {
				depth--
			}
			inObj = s.isObject(depth)
			i++
		case ',':
			i++
		case '-', '0', '1', '2', '3', '4', '5', '6', '7', '8', '9':
			n, j := refParseNumber(b, i)
			if pend.id != kNone {
				s.apply(pend, s.parent(depth), value{kind: vNumber, num: n, isNum: true})
			}
			if pendIDKey && !s.out.enum.ok && n >= 0 && n < 1e15 && n == math.Trunc(n) {
				s.out.enum = enumCand{ok: true, prefix: fnv64(pendRaw), n: int64(n)}
			}
			i = j
		case 't', 'f', 'n':
			j := i
			for j < len(b) && b[j] >= 'a' && b[j] <= 'z' {
				j++
			}
			if pend.id != kNone {
				switch string(b[i:j]) {
				case "true":
					s.apply(pend, s.parent(depth), value{kind: vTrue})
				case "false":
					s.apply(pend, s.parent(depth), value{kind: vFalse})
				}
			}
			i = j
		default:
			// Garbage: skip it and keep reading what makes sense.
			i++
			continue
		}
		// A value, a closer or a comma ends the pending key; in an object
		// the next string is a key again (which also copes with missing
		// commas).
		pend, pendKey, pendIDKey = keySpec{}, kNone, false
		expectKey = inObj
		if i < len(b) && b[i] == ',' {
			i++ // the usual comma, without another trip round the loop
		}
	}
}

// isObject reports whether the container at depth is an object.
func (s *refScanner) isObject(depth int) bool {
	return depth > 0 && depth < refMaxTracked && s.objects[depth/64]&(uint64(1)<<(depth%64)) != 0
}

// parent returns the key id that opened the container at depth.
func (s *refScanner) parent(depth int) uint8 {
	if depth < refMaxParents {
		return s.parents[depth]
	}
	return kNone
}

// apply folds one key's value into its dimension; run has skipped the
// keys already settled. Distinct keys of one
// dimension add up with diminishing returns, as a noisy-OR of their
// contributions (0.6 and 0.5 make 0.8); a key counts once per body, so a
// field repeated in every message of a history is not more evidence.
func (s *refScanner) apply(k keySpec, parent uint8, v value) {
	c, id, dim := s.contribution(k, parent, &v)
	word, bit := id/64, uint64(1)<<(id%64)
	if c <= 0 || s.seen[word]&bit != 0 {
		return
	}
	s.seen[word] |= bit
	d := s.out.vec[dim]
	s.out.vec[dim] = d + c - d*c
}

// refKeyOf normalises a raw key and looks it up. It also says whether the key
// names an identifier (ends in "id"), whose numeric values may be
// enumerated.
func refKeyOf(raw []byte) (keySpec, bool) {
	if len(raw) > refMaxKeyRaw {
		return keySpec{}, false
	}
	var buf [normCap]byte
	k := raw
	if !refPlainKey(raw) {
		n, ok := refNormalize(raw, &buf)
		if !ok {
			return keySpec{}, false
		}
		k = buf[:n]
	}
	n := len(k)
	idKey := n >= 2 && k[n-2] == 'i' && k[n-1] == 'd'
	return refLookupKey(k), idKey
}

// refPlainKey reports whether raw is already normalised (lower-case letters
// and digits only, as most keys are), so it can be looked up without a copy.
func refPlainKey(raw []byte) bool {
	if len(raw) > normCap {
		return false
	}
	for _, c := range raw {
		if c-'a' >= 26 && c-'0' >= 10 {
			return false
		}
	}
	return true
}

// refNormalize unescapes raw JSON string contents into buf, lower-cased and
// without '_', '-', '.' and spaces. ok is false when the result did not fit
// or held a non-ASCII character; n is then the length of the usable prefix.
func refNormalize(raw []byte, buf *[normCap]byte) (n int, ok bool) {
	for j := 0; j < len(raw); j++ {
		c := raw[j]
		switch {
		case c-'a' < 26 || c-'0' < 10:
			// The common case: kept as is.
		case c == '_' || c == '-' || c == '.' || c == ' ':
			continue
		case c-'A' < 26:
			c += 'a' - 'A'
		case c == '\\':
			var keep bool
			c, j, keep, ok = refUnescapeByte(raw, j)
			if !ok {
				return n, false
			}
			if !keep {
				continue
			}
		case c >= 0x80:
			return n, false
		}
		if n == len(buf) {
			return n, false
		}
		buf[n] = c
		n++
	}
	return n, true
}

// refUnescapeByte decodes the escape starting at raw[j] (a backslash),
// returns the index of its last byte, and classifies the result as
// refNormalize does: keep is false for a separator, ok is false for a
// non-ASCII character or a broken escape.
func refUnescapeByte(raw []byte, j int) (c byte, last int, keep, ok bool) {
	j++
	if j >= len(raw) {
		return 0, j, false, false
	}
	switch e := raw[j]; e {
	case 'u':
		r, good := refHex4(raw, j+1)
		if !good || r >= 0x80 {
			return 0, j, false, false
		}
		c = byte(r)
		j += 4
	case 'n', 't', 'r', 'b', 'f':
		c = '\n' // a control character never matches a known name
	default:
		c = e
	}
	switch {
	case c == '_' || c == '-' || c == '.' || c == ' ':
		return c, j, false, true
	case c-'A' < 26:
		c += 'a' - 'A'
	}
	return c, j, true, true
}

// refHex4 parses the four hex digits of a \u escape at raw[j:].
func refHex4(raw []byte, j int) (rune, bool) {
	if j+4 > len(raw) {
		return 0, false
	}
	var r rune
	for _, c := range raw[j : j+4] {
		switch {
		case c >= '0' && c <= '9':
			c -= '0'
		case c >= 'a' && c <= 'f':
			c -= 'a' - 10
		case c >= 'A' && c <= 'F':
			c -= 'A' - 10
		default:
			return 0, false
		}
		r = r<<4 | rune(c)
	}
	return r, true
}

// refStringEnd returns the index of the quote closing a string that starts at
// b[start], or len(b) when it is never closed. Short strings are searched
// for a quote eight bytes at a time, long ones (tokens,
// message texts) with IndexByte; a quote preceded by an odd run of
// backslashes is refEscaped.
func refStringEnd(b []byte, start int) int { return refStringEndAfter(b, start, start) }

// refStringEndAfter is refStringEnd for a string whose bytes before j hold no
// quote.
func refStringEndAfter(b []byte, start, j int) int {
	for j+8 <= len(b) && j < start+32 {
		m := refQuoteBytes(binary.LittleEndian.Uint64(b[j:]))
		if m == 0 {
			j += 8
			continue
		}
		q := j + bits.TrailingZeros64(m)/8
		if !refEscaped(b, start, q) {
			return q
		}
		j = q + 1
	}
	return refStringEndFrom(b, start, j)
}

// refQuoteBytes marks (with the high bit of each byte) the bytes of w that are
// '"'. The lowest mark is always exact, which is all refStringEnd uses.
func refQuoteBytes(w uint64) uint64 {
	const lo, hi = 0x0101010101010101, 0x8080808080808080
	q := w ^ (lo * '"')
	return (q - lo) &^ q & hi
}

// refEscaped reports whether the quote at b[q] follows an odd run of
// backslashes (counted no further back than start).
func refEscaped(b []byte, start, q int) bool {
	n := 0
	for p := q - 1; p >= start && b[p] == '\\'; p-- {
		n++
	}
	return n%2 == 1
}

// refStringEndFrom is refStringEnd's general case: IndexByte from j, then a count
// of the backslashes before each quote found.
func refStringEndFrom(b []byte, start, j int) int {
	for {
		if j >= len(b) {
			return len(b)
		}
		k := bytes.IndexByte(b[j:], '"')
		if k < 0 {
			return len(b)
		}
		q := j + k
		if !refEscaped(b, start, q) {
			return q
		}
		j = q + 1
	}
}

// refEmptyContainer reports whether the container opened just before b[i]
// closes at once.
func refEmptyContainer(b []byte, i int) bool {
	for ; i < len(b); i++ {
		switch b[i] {
		case ' ', '\t', '\n', '\r':
		case '}', ']':
			return true
		default:
			return false
		}
	}
	return true
}

// refParseNumber reads a JSON number at b[i:] (leniently) and returns it and
// the index after it. Precision beyond what thresholds need is not kept.
func refParseNumber(b []byte, i int) (float64, int) {
	neg := false
	if i < len(b) && b[i] == '-' {
		neg = true
		i++
	}
	var mant uint64
	digits, exp := 0, 0
	for ; i < len(b) && isDigit(b[i]); i++ {
		if digits < 18 {
			mant = mant*10 + uint64(b[i]-'0')
			if mant != 0 {
				digits++
			}
		} else {
			exp++
		}
	}
	if i < len(b) && b[i] == '.' {
		for i++; i < len(b) && isDigit(b[i]); i++ {
			if digits < 18 {
				mant = mant*10 + uint64(b[i]-'0')
				if mant != 0 {
					digits++
				}
				exp--
			}
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		eneg := false
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			eneg = b[i] == '-'
			i++
		}
		e := 0
		for ; i < len(b) && isDigit(b[i]); i++ {
			if e < 10000 {
				e = e*10 + int(b[i]-'0')
			}
		}
		if eneg {
			e = -e
		}
		exp += e
	}
	f := 0.0
	if mant != 0 {
		// Pow10 saturates to 0 or +Inf, never NaN, for huge exponents.
		f = float64(mant) * math.Pow10(exp)
	}
	if neg {
		f = -f
	}
	return f, i
}
