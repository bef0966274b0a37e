// Package randhex makes the random ids faregate names things with, as
// lowercase hex: task ids, request ids, script attempt ids.
//
// There is one function and one source, crypto/rand, so no id is ever
// guessable whatever it comes to be used for. New(16) costs about 0.33 µs,
// the math/rand/v2 version 0.24 µs (same run, go test -bench .
// ./protect/randhex): nothing next to the Redis round trip or the HTTP
// answer each id goes with.
package randhex

import (
	"crypto/rand"
	"encoding/hex"
)

// New returns n random bytes as 2n lowercase hex digits: 128 bits is
// New(16). It allocates only the string.
func New(n int) string {
	if n <= 0 {
		return ""
	}
	var stack [64]byte
	buf := stack[:]
	if 3*n > len(stack) {
		buf = make([]byte, 3*n)
	}
	raw, out := buf[:n], buf[n:3*n]
	// crypto/rand.Read never returns an error since Go 1.24: it stops the
	// program itself when the system has no randomness to give.
	_, _ = rand.Read(raw)
	hex.Encode(out, raw)
	return string(out)
}
