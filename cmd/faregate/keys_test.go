package main

import (
	"bytes"
	"regexp"
	"strings"
	"testing"

	"faregate/protect/policy"
	"faregate/protect/principal"
)

// keyLine and policyLine find the two things `keys new` prints.
var (
	keyLine    = regexp.MustCompile(`(?m)^\s*(fg_[0-9A-Za-z]+)\s*$`)
	policyLine = regexp.MustCompile(`(?m)^  - \{id: ([a-z0-9_-]+), sha256: "([0-9a-f]{64})", tier: ([a-z0-9_-]+)\}$`)
)

func TestKeysNewParsesBack(t *testing.T) {
	var out bytes.Buffer
	if err := runKeys([]string{"new", "-id", "acme", "-tier", "partner"}, &out); err != nil {
		t.Fatal(err)
	}
	text := out.String()
	km := keyLine.FindAllStringSubmatch(text, -1)
	pm := policyLine.FindStringSubmatch(text)
	if len(km) != 1 || pm == nil {
		t.Fatalf("want one key line and one policy line, got:\n%s", text)
	}
	key := km[0][1]
	if n := strings.Count(text, key); n != 1 {
		t.Errorf("the key is printed %d times, want once", n)
	}
	if pm[1] != "acme" || pm[3] != "partner" {
		t.Errorf("policy line names %s/%s, want acme/partner", pm[1], pm[3])
	}
	if pm[2] != policy.HashKey(key) {
		t.Errorf("line's sha256 %s is not sha256(key) %s", pm[2], policy.HashKey(key))
	}
	if !strings.Contains(text, "only the sha256 goes into the policy") {
		t.Errorf("no hint that only the hash goes into the policy:\n%s", text)
	}

	// Pasted under keys: of a policy, the line admits the printed key.
	file := "tiers:\n  partner: {tasks_per_day: 500, tokens_per_day: 2000000, requests_per_minute: 600}\nkeys:\n" + pm[0] + "\n"
	p, err := policy.Parse([]byte(file), "pasted.yaml", principal.Tier{TasksPerDay: 5, TokensPerDay: 40000, RequestsPerMinute: 120})
	if err != nil {
		t.Fatalf("the printed line does not parse: %v", err)
	}
	k, err := p.Authenticate(key)
	if err != nil || k != (policy.Key{ID: "acme", Tier: "partner"}) {
		t.Fatalf("Authenticate(printed key) = %+v, %v", k, err)
	}

	// A second run makes another key.
	var again bytes.Buffer
	if err := runKeys([]string{"new", "-id", "acme", "-tier", "partner"}, &again); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(again.String(), key) {
		t.Error("two runs printed the same key")
	}
}

func TestKeysNewRefuses(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want []string // every one in the error
	}{
		{"no subcommand", nil, []string{"usage: faregate keys new"}},
		{"unknown subcommand", []string{"list"}, []string{"usage: faregate keys new"}},
		{"missing flags", []string{"new"}, []string{`-id ""`, `-tier ""`}},
		{"bad id and tier together", []string{"new", "-id", "Acme Corp", "-tier", "Gold!"}, []string{`-id "Acme Corp"`, `-tier "Gold!"`}},
		{"public tier", []string{"new", "-id", "acme", "-tier", "public"}, []string{"anonymous lane"}},
		{"long id", []string{"new", "-id", strings.Repeat("a", 65), "-tier", "p"}, []string{"-id"}},
		{"stray argument", []string{"new", "-id", "a", "-tier", "p", "extra"}, []string{"unexpected arguments"}},
		{"unknown flag", []string{"new", "-id", "a", "-tier", "p", "-sha", "x"}, []string{"-sha"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out bytes.Buffer
			err := runKeys(tt.args, &out)
			if err == nil {
				t.Fatalf("accepted; printed:\n%s", out.String())
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
			if strings.Contains(out.String(), policy.KeyPrefix) && keyLine.MatchString(out.String()) {
				t.Errorf("a refused run printed a key:\n%s", out.String())
			}
		})
	}
	var out bytes.Buffer
	if err := runKeys([]string{"new", "-h"}, &out); err != nil || !strings.Contains(out.String(), "-tier") {
		t.Errorf("-h: %v, printed %q", err, out.String())
	}
}
