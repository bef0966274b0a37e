package randhex

import (
	"crypto/rand"
	"encoding/hex"
	mrand "math/rand/v2"
	"regexp"
	"strings"
	"testing"
)

// TestNew: 2n lowercase hex digits, never repeated in 100,000 draws, one
// allocation (the string) for the sizes in use.
func TestNew(t *testing.T) {
	for _, n := range []int{1, 12, 16, 21, 40} {
		s := New(n)
		if len(s) != 2*n || strings.Trim(s, "0123456789abcdef") != "" {
			t.Fatalf("New(%d) = %q", n, s)
		}
	}
	if New(0) != "" || New(-1) != "" {
		t.Fatal("New of no bytes is not empty")
	}
	seen := make(map[string]bool, 100_000)
	for range 100_000 {
		s := New(16)
		if seen[s] {
			t.Fatalf("%s drawn twice", s)
		}
		seen[s] = true
	}
	for _, n := range []int{12, 16} {
		if raceOn {
			break
		}
		if a := testing.AllocsPerRun(100, func() { _ = New(n) }); a != 1 {
			t.Errorf("New(%d): %v allocations, want 1", n, a)
		}
	}
}

// TestUUID: version 4 in the canonical form, never repeated in 100,000
// draws, one allocation (the string).
func TestUUID(t *testing.T) {
	seen := make(map[string]bool, 100_000)
	for range 100_000 {
		u := UUID()
		if !uuidRE.MatchString(u) {
			t.Fatalf("UUID() = %q, not a version 4 UUID", u)
		}
		if seen[u] {
			t.Fatalf("%s drawn twice", u)
		}
		seen[u] = true
	}
	if a := testing.AllocsPerRun(100, func() { _ = UUID() }); a != 1 && !raceOn {
		t.Errorf("UUID: %v allocations, want 1", a)
	}
}

var uuidRE = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)

func BenchmarkNew16(b *testing.B) {
	for b.Loop() {
		_ = New(16)
	}
}

// BenchmarkMathRand16 is the fast generator the request and attempt ids
// used before, for comparison in the same run.
func BenchmarkMathRand16(b *testing.B) {
	var raw [16]byte
	var out [32]byte
	for b.Loop() {
		for i := range raw {
			raw[i] = byte(mrand.Uint32())
		}
		hex.Encode(out[:], raw[:])
		_ = string(out[:])
	}
}

// BenchmarkRandText is crypto/rand.Text, the op ids' generator.
func BenchmarkRandText(b *testing.B) {
	for b.Loop() {
		_ = rand.Text()
	}
}
