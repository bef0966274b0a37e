package policy

import (
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
)

// keyedPolicy has one enabled and one disabled key of tier partner.
func keyedPolicy(t *testing.T, enabled, disabled string) *Policy {
	t.Helper()
	file := "tiers:\n  partner: {tasks_per_day: 500, tokens_per_day: 2000000, requests_per_minute: 600}\nkeys:\n" +
		"  - {id: acme, sha256: " + HashKey(enabled) + ", tier: partner}\n" +
		"  - {id: gone, sha256: " + HashKey(disabled) + ", tier: partner, disabled: true}\n"
	p, err := Parse([]byte(file), "keys.yaml", envDefaults)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestAuthenticate(t *testing.T) {
	enabled, disabled := NewKey(), NewKey()
	p := keyedPolicy(t, enabled, disabled)
	hexKey := "fg_" + strings.Repeat("0f", 16) // 128 bits in hex is accepted too
	tests := []struct {
		name   string
		bearer string
		fault  KeyFault // "" = accepted
	}{
		{"valid", enabled, ""},
		{"unknown", NewKey(), KeyUnknown},
		{"unknown hex key", hexKey, KeyUnknown},
		{"disabled", disabled, KeyDisabled},
		{"wrong prefix", "sk_" + enabled[3:], KeyMalformed},
		{"upper-case prefix", "FG_" + enabled[3:], KeyMalformed},
		{"no prefix", enabled[3:], KeyMalformed},
		{"too short", enabled[:3+21], KeyMalformed},
		{"too long", "fg_" + strings.Repeat("a", 129), KeyMalformed},
		{"bad characters", enabled[:10] + "-_+/" + enabled[14:], KeyMalformed},
		{"trailing space", enabled + " ", KeyMalformed},
		{"non-ASCII", enabled[:20] + "é" + enabled[22:], KeyMalformed},
		{"empty", "", KeyMalformed},
		{"prefix only", "fg_", KeyMalformed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			k, err := p.Authenticate(tt.bearer)
			if tt.fault == "" {
				if err != nil || k != (Key{ID: "acme", Tier: "partner"}) {
					t.Fatalf("Authenticate = %+v, %v; want acme", k, err)
				}
				return
			}
			if !errors.Is(err, ErrInvalidKey) {
				t.Fatalf("err = %v, want ErrInvalidKey", err)
			}
			var ke *KeyError
			if !errors.As(err, &ke) || ke.Fault != tt.fault {
				t.Fatalf("err = %#v, want fault %q", err, tt.fault)
			}
			if k != (Key{}) {
				t.Errorf("refused key still returned %+v", k)
			}
			if len(tt.bearer) > 4 && strings.Contains(err.Error(), tt.bearer[3:]) {
				t.Errorf("error %q contains the key", err)
			}
			if tt.fault == KeyDisabled && ke.ID != "gone" {
				t.Errorf("disabled key's id = %q, want gone", ke.ID)
			}
		})
	}
}

func TestAuthenticateWithoutPolicyFile(t *testing.T) {
	_, err := Default(envDefaults).Authenticate(NewKey())
	if !errors.Is(err, ErrInvalidKey) {
		t.Fatalf("err = %v, want ErrInvalidKey: a key never falls back to the public lane", err)
	}
}

func TestNewKey(t *testing.T) {
	seen := make(map[string]bool)
	for range 200 {
		k := NewKey()
		if !keyShape.MatchString(k) || len(k) != len(KeyPrefix)+keyBodyLen {
			t.Fatalf("NewKey() = %q: not fg_ + %d base62 characters", k, keyBodyLen)
		}
		if seen[k] {
			t.Fatalf("NewKey repeated %q", k)
		}
		seen[k] = true
	}
	// Every base62 character turns up across 200×32 draws; a biased or
	// truncated alphabet would miss some (each is missed with p ≈ 1e-45).
	var chars [128]bool
	for k := range seen {
		for _, c := range k[len(KeyPrefix):] {
			chars[c] = true
		}
	}
	for _, c := range keyChars {
		if !chars[c] {
			t.Errorf("character %q never generated", c)
		}
	}
}

func TestBearerToken(t *testing.T) {
	tests := []struct {
		name    string
		values  []string // Authorization header values; nil = none
		token   string
		present bool
	}{
		{"none", nil, "", false},
		{"plain", []string{"Bearer fg_abc"}, "fg_abc", true},
		{"lower-case scheme", []string{"bearer fg_abc"}, "fg_abc", true},
		{"shouting scheme", []string{"BEARER fg_abc"}, "fg_abc", true},
		{"extra spaces", []string{"  Bearer    fg_abc  "}, "fg_abc", true},
		{"tab", []string{"Bearer\tfg_abc"}, "fg_abc", true},
		{"empty header", []string{""}, "", true},
		{"scheme only", []string{"Bearer"}, "", true},
		{"scheme and spaces", []string{"Bearer   "}, "", true},
		{"other scheme", []string{"Basic dXNlcjpwYXNz"}, "", true},
		{"token without scheme", []string{"fg_abc"}, "", true},
		{"two tokens", []string{"Bearer fg_abc fg_def"}, "", true},
		{"two headers", []string{"Bearer fg_abc", "Bearer fg_def"}, "", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := http.Header{}
			for _, v := range tt.values {
				h.Add("authorization", v)
			}
			token, present := BearerToken(h)
			if token != tt.token || present != tt.present {
				t.Errorf("BearerToken = %q, %v; want %q, %v", token, present, tt.token, tt.present)
			}
		})
	}
}

func TestValidNames(t *testing.T) {
	for _, tt := range []struct {
		s        string
		id, tier bool
	}{
		{s: "acme", id: true, tier: true},
		{s: "a_b-9", id: true, tier: true},
		{s: strings.Repeat("x", 32), id: true, tier: true},
		{s: strings.Repeat("x", 33), id: true, tier: false},
		{s: strings.Repeat("x", 64), id: true, tier: false},
		{s: strings.Repeat("x", 65), id: false, tier: false},
		{s: "", id: false, tier: false},
		{s: "Acme", id: false, tier: false},
		{s: "a b", id: false, tier: false},
		{s: "a.b", id: false, tier: false},
	} {
		if got := ValidKeyID(tt.s); got != tt.id {
			t.Errorf("ValidKeyID(%q) = %v", tt.s, got)
		}
		if got := ValidTierName(tt.s); got != tt.tier {
			t.Errorf("ValidTierName(%q) = %v", tt.s, got)
		}
	}
}

// BenchmarkAuthenticate shows the cost of comparing every stored hash.
func BenchmarkAuthenticate(b *testing.B) {
	var file strings.Builder
	file.WriteString("tiers:\n  p: {tasks_per_day: 1, tokens_per_day: 1, requests_per_minute: 1}\nkeys:\n")
	var last string
	for i := range 1000 {
		last = NewKey()
		fmt.Fprintf(&file, "  - {id: k%04d, sha256: %s, tier: p}\n", i, HashKey(last))
	}
	p, err := Parse([]byte(file.String()), "bench", envDefaults)
	if err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if _, err := p.Authenticate(last); err != nil {
			b.Fatal(err)
		}
	}
}
