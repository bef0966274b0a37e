package aitf

import (
	"encoding/binary"
	"testing"
)

// TestNonPlainBytes holds the word-at-a-time classifier to plainKey's rule
// for every byte value in every position of a word, next to neighbours
// that would carry into it if the sums were not byte-wise.
func TestNonPlainBytes(t *testing.T) {
	for _, fill := range []byte{'a', 'z', '0', '9', 0x00, 0x7f, 0x80, 0xff, '"', '_'} {
		for pos := range 8 {
			for c := range 256 {
				var w [8]byte
				for k := range w {
					w[k] = fill
				}
				w[pos] = byte(c)
				m := nonPlainBytes(binary.LittleEndian.Uint64(w[:]))
				for k := range w {
					want := !plainKey(w[k : k+1])
					if got := m>>(8*k+7)&1 == 1; got != want {
						t.Fatalf("word %q: byte %d (%#x) marked %v, want %v", w, k, w[k], got, want)
					}
				}
				if m&^0x8080808080808080 != 0 {
					t.Fatalf("word %q: marks outside the high bits: %#x", w, m)
				}
			}
		}
	}
}
