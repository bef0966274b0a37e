// Package randhex makes the random ids faregate names things with, as
// lowercase hex: task ids, request ids, script attempt ids, and the UUIDs
// a wire may ask for.
//
// There is one source, crypto/rand, so no id is ever guessable whatever it
// comes to be used for. New(16) costs about 0.33 µs,
// the math/rand/v2 version 0.24 µs (same run, go test -bench .
// ./protect/kit/randhex): nothing next to the Redis round trip or the HTTP
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

// UUID returns a random (version 4) UUID, for a wire that asks for one
// (Turnstile's siteverify idempotency_key): 122 random bits in the
// canonical 8-4-4-4-12 lowercase form.
func UUID() string {
	var raw [16]byte
	_, _ = rand.Read(raw[:])
	raw[6] = raw[6]&0x0f | 0x40 // version 4
	raw[8] = raw[8]&0x3f | 0x80 // the RFC 9562 variant
	var out [36]byte
	hex.Encode(out[0:8], raw[0:4])
	hex.Encode(out[9:13], raw[4:6])
	hex.Encode(out[14:18], raw[6:8])
	hex.Encode(out[19:23], raw[8:10])
	hex.Encode(out[24:36], raw[10:16])
	out[8], out[13], out[18], out[23] = '-', '-', '-', '-'
	return string(out[:])
}
