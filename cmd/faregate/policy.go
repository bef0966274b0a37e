package main

import (
	"faregate/api"
	"faregate/protect/policy"
	"faregate/protect/principal"
)

// policyView adapts the policy file's immutable *policy.Policy to what the
// API asks of it. A request takes one view and keeps it, so a reload never
// mixes two policies in one request.
type policyView struct{ p *policy.Policy }

var _ api.Policy = policyView{}

// Public is the anonymous lane's tier.
func (v policyView) Public() principal.Tier { return v.p.Public() }

// Authenticate resolves a bearer token to its key's id and tier.
func (v policyView) Authenticate(token string) (string, principal.Tier, error) {
	k, err := v.p.Authenticate(token)
	if err != nil {
		return "", principal.Tier{}, err
	}
	t, ok := v.p.Tier(k.Tier)
	if !ok {
		// Load refuses a key whose tier is undefined; this cannot happen.
		return "", principal.Tier{}, &policy.KeyError{Fault: policy.KeyUnknown}
	}
	return k.ID, t, nil
}

// CheckPrompt names the first static prompt rule the texts match.
func (v policyView) CheckPrompt(texts ...string) (string, bool) { return v.p.CheckPrompt(texts...) }
