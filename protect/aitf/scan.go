package aitf

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"math"
	"math/bits"
)

const (
	// maxTracked is how many nesting levels remember whether they are an
	// object or an array. Deeper containers are read as arrays, so their
	// keys are ignored; a 16 KiB body cannot nest objects with keys
	// ({"a": is five bytes) deeper than 3,300 levels.
	maxTracked = 1 << 12
	// shallowTracked levels keep that bit in one word; only a body nesting
	// deeper is scanned again with the 512 bytes of bits for maxTracked
	// (zeroing those for every body cost about 2% of a 1 KiB scan).
	shallowTracked = 64
	// maxParents is how many levels remember the key that opened them.
	maxParents = 64
	// maxKeyRaw bounds the escaped length of a key worth decoding: every
	// known key is shorter, even written entirely in \u escapes.
	maxKeyRaw = 6 * 24
	// normCap bounds a normalised key or value.
	normCap = 40
	// maxToolID bounds a captured tool call id.
	maxToolID = 256
)

// valueKind is the JSON type of a value the scanner met.
type valueKind uint8

const (
	vString valueKind = iota + 1
	vNumber
	vTrue
	vFalse
	vNull
	vObject
	vArray
)

// value is one JSON value as the scanner saw it, without copying.
type value struct {
	kind  valueKind
	num   float64
	isNum bool   // a number, or a string holding only a number
	empty bool   // an empty object or array
	raw   []byte // string contents between the quotes, still escaped
	off   int    // offset of raw in the body
}

// present reports whether a value counts as "set": not null, false, zero,
// or empty.
func (v value) present() bool {
	switch v.kind {
	case vString:
		return len(v.raw) > 0
	case vNumber:
		return v.num != 0
	case vTrue:
		return true
	case vObject, vArray:
		return !v.empty
	}
	return false
}

// enumCand is an identifier that may be part of an enumeration: a prefix
// (hashed) and a number.
type enumCand struct {
	ok     bool
	prefix uint64
	n      int64
}

// scanResult is what one pass over a body yields.
type scanResult struct {
	vec     Vector
	toolOff int // offset and length of the raw (escaped) tool call id
	toolLen int
	enum    enumCand
}

// scanner holds the state of one pass. It lives on the caller's stack.
type scanner struct {
	out     scanResult
	deep    *[maxTracked / 64]uint64 // bit set: the container at that depth is an object; nil until a body nests deeper than shallowTracked
	parents [maxParents]uint8        // key id that opened the container at that depth
	seen    [4]uint64                // key ids already counted
	memo    *[memoSize]memoKey       // keys met in this body; nil for short bodies
}

// memoSize is how many distinct keys a body's memo holds; agent bodies
// repeat a dozen keys in every message of their history.
const memoSize = 32

// memoMin is the body size from which the memo pays for itself: a short
// body repeats few keys, and clearing the memo costs more than it saves.
const memoMin = 4 << 10

// memoKey is a key met earlier in the body, as its offset and length there,
// and what keyOf made of it.
type memoKey struct {
	off   int
	n     uint8 // at most maxKeyRaw
	idKey bool
	spec  keySpec
}

// key is keyOf with a memo: a key written byte for byte as one met earlier
// in the body is not normalised and looked up again.
func (s *scanner) key(b []byte, off int, raw []byte) (keySpec, bool) {
	n := len(raw)
	if n == 0 || n > maxKeyRaw {
		return keyOf(raw)
	}
	m := &s.memo[(n+int(raw[0])+int(raw[n-1])<<1)%memoSize]
	if int(m.n) == n && string(b[m.off:m.off+n]) == string(raw) {
		return m.spec, m.idKey
	}
	spec, idKey := keyOf(raw)
	*m = memoKey{off: off, n: uint8(n), idKey: idKey, spec: spec}
	return spec, idKey
}

// scan reads body once and returns the body dimensions, the tool call id's
// position and the first enumeration candidate.
func scan(body []byte) scanResult { return scanMemo(body, len(body) >= memoMin) }

// scanMemo is scan with the key memo on or off (the memo must not change
// the result; a test holds it to that).
func scanMemo(body []byte, useMemo bool) scanResult {
	var s scanner
	if useMemo {
		// Declared here, the memo is zeroed only for the bodies that use it.
		var memo [memoSize]memoKey
		s.memo = &memo
	}
	if s.run(body) {
		return s.out
	}
	// The body nests deeper than shallowTracked: scan it again, from
	// scratch, with a bit per level up to maxTracked. The memo, which only
	// caches what the body's own keys are, stays valid.
	var deep [maxTracked / 64]uint64
	s = scanner{deep: &deep, memo: s.memo}
	s.run(body)
	return s.out
}

// run is the single pass. It never recurses and never looks back more than
// a string's trailing backslashes, so any input, valid or not, costs O(n).
// Without s.deep it stops, reporting false, at the first container nested
// deeper than shallowTracked.
//
// It is one long function on purpose: split to under 80 lines (its key
// reading, string ends, containers, numbers and words in calls of their
// own, which the compiler does not inline), BenchmarkScore/clean-1KiB (the
// page's own kind of request) took 4.5 % more CPU, cpu-ns/op 594 → 620
// (go test -bench 'BenchmarkScore$' -count 10, before and after in one
// run; p < 0.001); the agent bodies' figures did not move.
func (s *scanner) run(b []byte) bool {
	var (
		depth     int
		objects   uint64  // bit d set: the container at depth d < shallowTracked is an object
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
			if expectKey && i+9 <= len(b) {
				// Most keys are plain (lower-case letters and digits):
				// one pass of words finds their end and proves them
				// plain, so they are looked up as written. The first
				// word, which holds most keys whole, is read here.
				// Snake-case keys (tool_call_id) only lose their
				// underscores; a long body's memo, which saves their
				// normalising on every repeat, is quicker still.
				q := -1
				if m := nonPlainBytes(binary.LittleEndian.Uint64(b[i+1:])); m == 0 {
					q = firstNonPlain(b, i+1, i+9)
				} else {
					q = i + 1 + bits.TrailingZeros64(m)/8
				}
				end := -1
				if q >= 0 && b[q] == '"' && q-(i+1) <= normCap {
					end = q
					raw := b[i+1 : end]
					pend = lookupKey(raw)
					n := len(raw)
					pendIDKey = n >= 2 && raw[n-2] == 'i' && raw[n-1] == 'd'
				} else if q >= 0 && b[q] == '_' && q-(i+1) < normCap && s.memo == nil {
					end, pend, pendIDKey = snakeKey(b, i+1)
				}
				if end >= 0 {
					raw := b[i+1 : end]
					pendKey = pend.id
					if pend.id != kNone && s.settled(pend) {
						pend.id = kNone
					}
					pendRaw = raw
					expectKey = false
					i = end + 1
					if i < len(b) && b[i] == ':' {
						i++
					}
					continue
				}
			}
			// Most keys and ids close within their first eight bytes;
			// that case is checked here, inline, the rest in stringEnd.
			end := -1
			if i+9 <= len(b) {
				if m := quoteBytes(binary.LittleEndian.Uint64(b[i+1:])); m == 0 {
					// No quote in the first eight bytes: search on from there.
					end = stringEndAfter(b, i+1, i+9)
				} else if q := i + 1 + bits.TrailingZeros64(m)/8; b[q-1] != '\\' {
					end = q
				}
			}
			if end < 0 {
				end = stringEnd(b, i+1)
			}
			raw := b[i+1 : end]
			if expectKey {
				if s.memo != nil {
					pend, pendIDKey = s.key(b, i+1, raw)
				} else {
					pend, pendIDKey = keyOf(raw)
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
					if n, j := parseNumber(raw, 0); j == len(raw) {
						v.num, v.isNum = n, true
					}
				}
				s.apply(pend, s.parent(depth), &v)
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
				s.apply(pend, s.parent(depth), &value{kind: kind, empty: emptyContainer(b, i+1)})
			}
			if pendKey != kNone {
				parent = pendKey
			} else if depth > 0 && !inObj {
				// Elements of an array belong to the array's key, so
				// tool_calls[0].function is still inside tool_calls.
				parent = s.parent(depth)
			}
			depth++
			inObj = kind == vObject && depth < maxTracked
			switch {
			case depth < shallowTracked:
				bit := uint64(1) << depth
				if inObj {
					objects |= bit
				} else {
					objects &^= bit
				}
			case s.deep == nil:
				return false
			case depth < maxTracked:
				bit := uint64(1) << (depth % 64)
				if inObj {
					s.deep[depth/64] |= bit
				} else {
					s.deep[depth/64] &^= bit
				}
			}
			if depth < maxParents {
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
			if depth < shallowTracked {
				inObj = objects&(uint64(1)<<depth) != 0 // bit 0 is never set: depth 0 is no container
			} else {
				inObj = s.isDeepObject(depth)
			}
			i++
		case ',':
			i++
		case '-', '0', '1', '2', '3', '4', '5', '6', '7', '8', '9':
			n, j := parseNumber(b, i)
			if pend.id != kNone {
				s.apply(pend, s.parent(depth), &value{kind: vNumber, num: n, isNum: true})
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
					s.apply(pend, s.parent(depth), &value{kind: vTrue})
				case "false":
					s.apply(pend, s.parent(depth), &value{kind: vFalse})
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
	return true
}

// isDeepObject reports whether the container at depth (at least
// shallowTracked, so run has s.deep) is an object.
func (s *scanner) isDeepObject(depth int) bool {
	return depth < maxTracked && s.deep[depth/64]&(uint64(1)<<(depth%64)) != 0
}

// parent returns the key id that opened the container at depth.
func (s *scanner) parent(depth int) uint8 {
	if depth < maxParents {
		return s.parents[depth]
	}
	return kNone
}

// apply folds one key's value into its dimension; run has skipped the
// keys already settled. Distinct keys of one
// dimension add up with diminishing returns, as a noisy-OR of their
// contributions (0.6 and 0.5 make 0.8); a key counts once per body, so a
// field repeated in every message of a history is not more evidence.
func (s *scanner) apply(k keySpec, parent uint8, v *value) {
	c, id, dim := s.contribution(k, parent, v)
	word, bit := id/64, uint64(1)<<(id%64)
	if c <= 0 || s.seen[word]&bit != 0 {
		return
	}
	s.seen[word] |= bit
	d := s.out.vec[dim]
	s.out.vec[dim] = d + c - d*c
}

// captureToolID remembers the first tool call id's position.
func (s *scanner) captureToolID(v value) {
	if s.out.toolLen == 0 {
		s.out.toolOff, s.out.toolLen = v.off, min(len(v.raw), maxToolID)
	}
}

// toolID returns the captured tool call id, unescaped. It allocates, but
// only for bodies that carry one.
func (r scanResult) toolID(body []byte) string {
	if r.toolLen == 0 || r.toolOff+r.toolLen > len(body) {
		return ""
	}
	return unescape(body[r.toolOff : r.toolOff+r.toolLen])
}

// keyOf normalises a raw key and looks it up. It also says whether the key
// names an identifier (ends in "id"), whose numeric values may be
// enumerated.
func keyOf(raw []byte) (keySpec, bool) {
	if len(raw) > maxKeyRaw {
		return keySpec{}, false
	}
	var buf [normCap]byte
	k := raw
	if !plainKey(raw) {
		n, ok := normalize(raw, &buf)
		if !ok {
			return keySpec{}, false
		}
		k = buf[:n]
	}
	n := len(k)
	idKey := n >= 2 && k[n-2] == 'i' && k[n-1] == 'd'
	return lookupKey(k), idKey
}

// plainKey reports whether raw is already normalised (lower-case letters
// and digits only, as most keys are), so it can be looked up without a copy.
func plainKey(raw []byte) bool {
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

// normalize unescapes raw JSON string contents into buf, lower-cased and
// without '_', '-', '.' and spaces. ok is false when the result did not fit
// or held a non-ASCII character; n is then the length of the usable prefix.
func normalize(raw []byte, buf *[normCap]byte) (n int, ok bool) {
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
			c, j, keep, ok = unescapeByte(raw, j)
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

// unescapeByte decodes the escape starting at raw[j] (a backslash),
// returns the index of its last byte, and classifies the result as
// normalize does: keep is false for a separator, ok is false for a
// non-ASCII character or a broken escape.
func unescapeByte(raw []byte, j int) (c byte, last int, keep, ok bool) {
	j++
	if j >= len(raw) {
		return 0, j, false, false
	}
	switch e := raw[j]; e {
	case 'u':
		r, good := hex4(raw, j+1)
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

// hex4 parses the four hex digits of a \u escape at raw[j:].
func hex4(raw []byte, j int) (rune, bool) {
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

// stringEnd returns the index of the quote closing a string that starts at
// b[start], or len(b) when it is never closed. Short strings are searched
// for a quote eight bytes at a time, long ones (tokens,
// message texts) with IndexByte; a quote preceded by an odd run of
// backslashes is escaped.
//
// Measured against this in issue 20's third round (benchmark bodies,
// interleaved runs, busy machine) and not kept: sixteen bytes a step
// looking for a quote or a backslash at once, escapes stepped over
// forward, IndexByte only from 128 bytes (0.93x at 1 KiB, 0.87x at
// 16 KiB); turning to IndexByte after 16 or after 64 bytes instead of 32
// (0.98x, 0.99x); a second word read inline before stringEndAfter (0.98x
// at 1 KiB).
func stringEnd(b []byte, start int) int { return stringEndAfter(b, start, start) }

// stringEndAfter is stringEnd for a string whose bytes before j hold no
// quote.
func stringEndAfter(b []byte, start, j int) int {
	for j+8 <= len(b) && j < start+32 {
		m := quoteBytes(binary.LittleEndian.Uint64(b[j:]))
		if m == 0 {
			j += 8
			continue
		}
		q := j + bits.TrailingZeros64(m)/8
		if !escaped(b, start, q) {
			return q
		}
		j = q + 1
	}
	return stringEndFrom(b, start, j)
}

// firstNonPlain returns the index of the first byte of a key starting at
// b[start] that is not a lower-case letter or a digit (the closing quote,
// for a plain key), given that the bytes before j are; or -1 when there is
// none within normCap bytes and a word, and the caller reads the key the
// general way. It reads eight bytes at a time, so a key within eight
// bytes of the body's end also takes the general way.
func firstNonPlain(b []byte, start, j int) int {
	for ; j+8 <= len(b) && j <= start+normCap; j += 8 {
		if m := nonPlainBytes(binary.LittleEndian.Uint64(b[j:])); m != 0 {
			return j + bits.TrailingZeros64(m)/8
		}
	}
	return -1
}

// snakeKey reads a key that starts at b[start] whose bytes are lower-case
// letters, digits and underscores, normalises it (drops the underscores)
// and looks it up, as keyOf would. It returns the index of the closing
// quote, or -1 (and the caller reads the key the general way) when the key
// holds any other byte or is longer than normCap as written. Finding the
// end a word at a time first and then copying without a branch per byte
// measured no quicker than this one loop.
func snakeKey(b []byte, start int) (end int, k keySpec, idKey bool) {
	var buf [normCap]byte
	n := 0
	for j := start; j < len(b) && j-start <= normCap; j++ {
		c := b[j]
		switch {
		case c-'a' < 26 || c-'0' < 10:
			buf[n] = c // n < normCap: the caller saw an underscore among the first normCap bytes
			n++
		case c == '_':
		case c == '"':
			if j-start > normCap {
				return -1, keySpec{}, false
			}
			idKey = n >= 2 && buf[n-2] == 'i' && buf[n-1] == 'd'
			return j, lookupKey(buf[:n]), idKey
		default:
			return -1, keySpec{}, false
		}
	}
	return -1, keySpec{}, false
}

// nonPlainBytes marks (with the high bit of each byte) the bytes of w that
// are not a lower-case ASCII letter or a digit. Every mark is exact: the
// byte-wise sums below never carry into the next byte.
func nonPlainBytes(w uint64) uint64 {
	const lo, hi = 0x0101010101010101, 0x8080808080808080
	x := w &^ hi // low seven bits of each byte
	geA := x + lo*(0x80-'a')
	gtZ := x + lo*(0x7f-'z')
	ge0 := x + lo*(0x80-'0')
	gt9 := x + lo*(0x7f-'9')
	plain := (geA &^ gtZ) | (ge0 &^ gt9)
	return (hi &^ plain) | (w & hi)
}

// quoteBytes marks (with the high bit of each byte) the bytes of w that are
// '"'. The lowest mark is always exact, which is all stringEnd uses.
func quoteBytes(w uint64) uint64 {
	const lo, hi = 0x0101010101010101, 0x8080808080808080
	q := w ^ (lo * '"')
	return (q - lo) &^ q & hi
}

// escaped reports whether the quote at b[q] follows an odd run of
// backslashes (counted no further back than start).
func escaped(b []byte, start, q int) bool {
	n := 0
	for p := q - 1; p >= start && b[p] == '\\'; p-- {
		n++
	}
	return n%2 == 1
}

// stringEndFrom is stringEnd's general case: IndexByte from j, then a count
// of the backslashes before each quote found.
func stringEndFrom(b []byte, start, j int) int {
	for {
		if j >= len(b) {
			return len(b)
		}
		k := bytes.IndexByte(b[j:], '"')
		if k < 0 {
			return len(b)
		}
		q := j + k
		if !escaped(b, start, q) {
			return q
		}
		j = q + 1
	}
}

// emptyContainer reports whether the container opened just before b[i]
// closes at once.
func emptyContainer(b []byte, i int) bool {
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

// parseNumber reads a JSON number at b[i:] (leniently) and returns it and
// the index after it. Precision beyond what thresholds need is not kept.
func parseNumber(b []byte, i int) (float64, int) {
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

// enumOf extracts an identifier of the form prefix+number ("doc_78901",
// "/api/docs/78901" is not one: the prefix must start with a letter and hold
// only letters and separators) for enumeration tracking.
func enumOf[T string | []byte](raw T) enumCand {
	n := len(raw)
	if n < 4 || n > 48 || !isDigit(raw[n-1]) || !isLetter(raw[0]) {
		return enumCand{}
	}
	j := n
	for j > 0 && isDigit(raw[j-1]) {
		j--
	}
	if d := n - j; d < 3 || d > 15 {
		return enumCand{}
	}
	h := uint64(fnvOffset)
	for k := 0; k < j; k++ {
		c := raw[k]
		switch {
		case isLetter(c) || c == '_' || c == '-' || c == '/' || c == ':' || c == '.':
		default:
			return enumCand{}
		}
		if c >= 'A' && c <= 'Z' {
			c += 'a' - 'A'
		}
		h = (h ^ uint64(c)) * fnvPrime
	}
	var num int64
	for k := j; k < n; k++ {
		num = num*10 + int64(raw[k]-'0')
	}
	return enumCand{ok: true, prefix: h, n: num}
}

const (
	fnvOffset = 14695981039346656037
	fnvPrime  = 1099511628211
)

// fnv64 is FNV-1a, inline and allocation-free.
func fnv64(b []byte) uint64 {
	h := uint64(fnvOffset)
	for _, c := range b {
		h = (h ^ uint64(c)) * fnvPrime
	}
	return h
}

// unescape decodes raw JSON string contents. Only the rare tool call id
// path calls it, so it may allocate.
func unescape(raw []byte) string {
	if bytes.IndexByte(raw, '\\') < 0 {
		return string(raw)
	}
	quoted := make([]byte, 0, len(raw)+2)
	quoted = append(append(append(quoted, '"'), raw...), '"')
	var s string
	if err := json.Unmarshal(quoted, &s); err != nil {
		// A truncated or broken escape: the raw text still identifies it.
		return string(raw)
	}
	return s
}

func isDigit(c byte) bool  { return c >= '0' && c <= '9' }
func isLetter(c byte) bool { return c|0x20 >= 'a' && c|0x20 <= 'z' }
