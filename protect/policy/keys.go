package policy

import (
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"regexp"
	"strings"
)

// ErrInvalidKey is what every refused key unwraps to: malformed, unknown
// or disabled. The api answers all three with 401 invalid_api_key and
// never falls back to the public lane.
var ErrInvalidKey = errors.New("policy: invalid api key")

// KeyFault says why a key was refused.
type KeyFault string

// The reasons a key is refused.
const (
	// KeyMalformed: not "fg_" followed by 22 to 128 letters and digits.
	KeyMalformed KeyFault = "malformed"
	// KeyUnknown: well formed, but no key of the policy has its SHA-256.
	KeyUnknown KeyFault = "unknown"
	// KeyDisabled: the policy has the key with disabled: true.
	KeyDisabled KeyFault = "disabled"
)

// KeyError is a refused key. It never holds the key: only the fault and,
// for a disabled key, the key's id (which may be logged).
type KeyError struct {
	Fault KeyFault
	// ID is the disabled key's id; empty for the other faults.
	ID string
}

// Error names the fault and a disabled key's id, never the key.
func (e *KeyError) Error() string {
	if e.ID != "" {
		return fmt.Sprintf("policy: api key %s is %s", e.ID, e.Fault)
	}
	return fmt.Sprintf("policy: api key is %s", e.Fault)
}

// Unwrap makes every KeyError an ErrInvalidKey.
func (e *KeyError) Unwrap() error { return ErrInvalidKey }

// KeyPrefix starts every faregate API key, so a leaked one is easy to
// recognise in logs and by secret scanners.
const KeyPrefix = "fg_"

const (
	// keyChars is the base62 alphabet of generated keys. A hex key
	// (also accepted) uses a subset of it.
	keyChars = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
	// keyBodyLen is the length of generated keys' random part:
	// 32 base62 characters hold 190 bits.
	keyBodyLen = 32
	// minKeyBody is the shortest accepted random part: 22 base62
	// characters hold 131 bits, the least that carries 128.
	minKeyBody = 22
	// maxKeyBody bounds what is hashed for a header anyone can send.
	maxKeyBody = 128
)

var (
	keyShape  = regexp.MustCompile(fmt.Sprintf(`^fg_[0-9A-Za-z]{%d,%d}$`, minKeyBody, maxKeyBody))
	idShape   = regexp.MustCompile(`^[a-z0-9_-]{1,64}$`)
	tierShape = regexp.MustCompile(`^[a-z0-9_-]{1,32}$`)
)

// ValidKeyID reports whether id can name a key: [a-z0-9_-]{1,64}.
func ValidKeyID(id string) bool { return idShape.MatchString(id) }

// ValidTierName reports whether name can name a tier: [a-z0-9_-]{1,32}.
func ValidTierName(name string) bool { return tierShape.MatchString(name) }

// NewKey returns a fresh API key: KeyPrefix and 32 base62 characters
// (190 random bits) from crypto/rand.
func NewKey() string {
	var b strings.Builder
	b.WriteString(KeyPrefix)
	buf := make([]byte, 64)
	for b.Len() < len(KeyPrefix)+keyBodyLen {
		// crypto/rand.Read never fails (it panics if the system cannot
		// give randomness).
		_, _ = rand.Read(buf)
		for _, c := range buf {
			// 248 = 4×62: rejecting higher bytes keeps the choice uniform.
			if c < 248 && b.Len() < len(KeyPrefix)+keyBodyLen {
				b.WriteByte(keyChars[c%62])
			}
		}
	}
	return b.String()
}

// HashKey is the hex SHA-256 of key, the form a policy file stores.
func HashKey(key string) string {
	sum := sha256.Sum256([]byte(key))
	return hex.EncodeToString(sum[:])
}

// Authenticate returns the key whose SHA-256 matches bearer, the token
// after "Bearer " (see BearerToken). A malformed, unknown or disabled key
// is a *KeyError that unwraps to ErrInvalidKey.
//
// Every stored hash is compared, in constant time, whatever matches, so
// the time taken says nothing about which key (if any) was close.
func (p *Policy) Authenticate(bearer string) (Key, error) {
	if !keyShape.MatchString(bearer) {
		return Key{}, &KeyError{Fault: KeyMalformed}
	}
	sum := sha256.Sum256([]byte(bearer))
	found := -1
	for i := range p.keys {
		eq := subtle.ConstantTimeCompare(sum[:], p.keys[i].sum[:])
		found = subtle.ConstantTimeSelect(eq, i, found)
	}
	if found < 0 {
		return Key{}, &KeyError{Fault: KeyUnknown}
	}
	k := p.keys[found].Key
	if k.Disabled {
		return Key{}, &KeyError{Fault: KeyDisabled, ID: k.ID}
	}
	return k, nil
}

// BearerToken extracts the token of an "Authorization: Bearer <token>"
// header. present is true whenever the request has an Authorization
// header at all, even an empty or malformed one: a client that sent a key
// is answered 401 when it is wrong, never served as the public lane. The
// scheme is matched without regard to case and blanks around the parts
// are ignored; any other scheme, a missing token, a token with blanks
// inside, or more than one Authorization header gives token "", which
// Authenticate refuses as malformed.
func BearerToken(h http.Header) (token string, present bool) {
	values := h.Values("Authorization")
	if len(values) == 0 {
		return "", false
	}
	if len(values) > 1 {
		return "", true
	}
	// Fields drops every run of blanks, so "bearer   fg_…  " is fine;
	// anything but exactly a scheme and one token is malformed.
	parts := strings.Fields(values[0])
	if len(parts) != 2 || !strings.EqualFold(parts[0], "Bearer") {
		return "", true
	}
	return parts[1], true
}
