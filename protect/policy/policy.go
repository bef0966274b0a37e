package policy

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"

	"faregate/protect/principal"
)

// SourceEnvironment is what Source reports for a policy built without a
// file, from the environment's defaults only.
const SourceEnvironment = "environment"

// Key is an API key as the policy names it. The key itself is never kept,
// only its SHA-256 (inside the Policy).
type Key struct {
	// ID names the key in logs, metrics and Redis scopes (k:<id>).
	ID string
	// Tier is the name of the key's tier.
	Tier string
	// Disabled keys are refused with ErrInvalidKey.
	Disabled bool
}

// Price is a model's price per million tokens in integer millionths of
// the operator's currency (0.15 → 150000), so that money is summed in
// integers.
type Price struct {
	// InputMicroPerMTok is the price of a million prompt tokens.
	InputMicroPerMTok int64
	// OutputMicroPerMTok is the price of a million completion tokens.
	OutputMicroPerMTok int64
	// CacheWriteMicroPerMTok and CacheReadMicroPerMTok are the prices of
	// a million prompt tokens written to and read from a provider's
	// prompt cache; 0: their defaults, 1.25 and 0.1 times the input price
	// (budget.Price).
	CacheWriteMicroPerMTok, CacheReadMicroPerMTok int64
}

// ErrInvalidPolicy is wrapped by every error about a policy file's
// content; the *ValidationError that wraps it lists the problems.
var ErrInvalidPolicy = errors.New("policy: invalid policy")

// Policy is one validated policy. It is immutable: a reload builds a new
// one, so a caller that holds a *Policy sees consistent tiers, keys and
// rules for as long as it holds it.
type Policy struct {
	source string
	tiers  map[string]principal.Tier
	keys   []keyEntry
	rules  []rule
	prices map[string]Price
}

// keyEntry is a Key with the SHA-256 of its secret.
type keyEntry struct {
	Key
	sum [32]byte
}

// Default is the policy without a file: the public tier from the
// environment's values and the built-in prompt rules, no keys, no prices.
// defaults.Name is ignored; a MaxSiteShare of 0 (unset) becomes 1.
func Default(defaults principal.Tier) *Policy {
	return &Policy{
		source: SourceEnvironment,
		tiers:  map[string]principal.Tier{principal.PublicTier: publicDefaults(defaults)},
		rules:  builtinRules,
		prices: map[string]Price{},
	}
}

func publicDefaults(d principal.Tier) principal.Tier {
	d.Name = principal.PublicTier
	if d.MaxSiteShare <= 0 || d.MaxSiteShare > 1 {
		d.MaxSiteShare = 1
	}
	return d
}

// Load reads and validates the policy file at path. defaults are the
// public tier's values from the environment; fields of the file's public
// tier replace them one by one. The error names every problem found.
func Load(path string, defaults principal.Tier) (*Policy, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("policy: %w", err)
	}
	return Parse(data, path, defaults)
}

// Source is the file the policy was read from, or SourceEnvironment.
func (p *Policy) Source() string { return p.source }

// Tier returns the tier named name.
func (p *Policy) Tier(name string) (principal.Tier, bool) {
	t, ok := p.tiers[name]
	return t, ok
}

// Public is the anonymous lane's tier; it always exists.
func (p *Policy) Public() principal.Tier { return p.tiers[principal.PublicTier] }

// Tiers lists every tier, public included, sorted by name.
func (p *Policy) Tiers() []principal.Tier {
	out := make([]principal.Tier, 0, len(p.tiers))
	for _, name := range slices.Sorted(maps.Keys(p.tiers)) {
		out = append(out, p.tiers[name])
	}
	return out
}

// Keys lists the policy's keys in file order, disabled ones included.
func (p *Policy) Keys() []Key {
	out := make([]Key, len(p.keys))
	for i, k := range p.keys {
		out[i] = k.Key
	}
	return out
}

// Prices returns a copy of the model prices the file gives (models:),
// by model name; empty without a file.
func (p *Policy) Prices() map[string]Price { return maps.Clone(p.prices) }

// Rules lists the names of the prompt rules in the order they are tried.
func (p *Policy) Rules() []string {
	out := make([]string, len(p.rules))
	for i, r := range p.rules {
		out[i] = r.name
	}
	return out
}

// RaisedTiers names the tiers of p whose limits are higher than in old:
// tasks_per_day, tokens_per_day, requests_per_minute, max_site_share,
// soft_at, soft_requests_per_minute, or tokens_per_minute,
// requests_per_second and tokens_per_hour (where 0, none, is the highest). A tier new in p
// is not listed: nobody was refused under it. Denials remembered for the
// principals of a listed tier (every visitor, for public) may now be
// wrong and should be forgotten. A nil old lists nothing.
func (p *Policy) RaisedTiers(old *Policy) []string {
	if old == nil {
		return nil
	}
	var out []string
	for _, name := range slices.Sorted(maps.Keys(p.tiers)) {
		was, ok := old.tiers[name]
		if ok && raised(was, p.tiers[name]) {
			out = append(out, name)
		}
	}
	return out
}

// RaisedKeys names the keys of p whose limits may be higher than in old:
// keys of a raised tier (RaisedTiers), keys that moved to another tier,
// were enabled again, or are new (an id can come back after its entry
// was deleted, with denials remembered from before). Their remembered
// denials (scope k:<id>) should be forgotten. A nil old lists nothing.
func (p *Policy) RaisedKeys(old *Policy) []string {
	if old == nil {
		return nil
	}
	up := make(map[string]bool)
	for _, t := range p.RaisedTiers(old) {
		up[t] = true
	}
	before := make(map[string]Key, len(old.keys))
	for _, k := range old.keys {
		before[k.ID] = k.Key
	}
	var out []string
	for _, k := range p.keys {
		if k.Disabled {
			continue
		}
		was, ok := before[k.ID]
		if !ok || was.Disabled || was.Tier != k.Tier || up[k.Tier] {
			out = append(out, k.ID)
		}
	}
	slices.Sort(out)
	return out
}

// raised reports whether any limit of now is above the one in was.
func raised(was, now principal.Tier) bool {
	return now.TasksPerDay > was.TasksPerDay ||
		now.TokensPerDay > was.TokensPerDay ||
		now.RequestsPerMinute > was.RequestsPerMinute ||
		now.MaxSiteShare > was.MaxSiteShare ||
		upOrOff(was.TokensPerMinute, now.TokensPerMinute) ||
		upOrOff(was.RequestsPerSecond, now.RequestsPerSecond) ||
		upOrOff(was.TokensPerHour, now.TokensPerHour) ||
		was.TokensPerHour != 0 && (now.SoftTokens() > was.SoftTokens() || now.SoftRequests() > was.SoftRequests())
}

// upOrOff reports whether a limit where 0 means none was raised: turned
// off, or set higher.
func upOrOff(was, now int64) bool {
	return was != 0 && (now == 0 || now > was)
}
