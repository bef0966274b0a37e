// Package principal names who a request or a task counts against, in every
// form the rest of faregate writes it, and the tier whose limits apply.
// The api resolves a request to a Principal; the task record keeps its
// Account; the agent, the budget, the rate limiter, the alerts and the
// logs turn that back into the form each needs through this package, never
// by cutting strings of their own. It imports only the standard library, so
// every floor may use it.
package principal

import "strings"

// Principal kinds.
const (
	KindVisitor = "visitor"
	KindKey     = "key"
)

// PublicTier is the anonymous visitors' tier. It exists in every policy and
// cannot be given keys.
const PublicTier = "public"

// shown is how much of a visitor's hash the display form keeps: enough to
// tell visitors apart in a day's logs and alerts, too little to be the key.
const shown = 12

// Principal is who a request counts against: an anonymous visitor (its
// keyed IP hash) or an API key (its id), with the tier whose limits apply.
type Principal struct {
	Kind string
	// ID is the visitor's 64-hex key or the API key's id.
	ID string
	// Tier is the name of the principal's tier.
	Tier string
}

// Scope is the principal's name in rate-limit keys: "v:<hash>" or "k:<id>".
func (p Principal) Scope() string {
	if p.Kind == KindKey {
		return "k:" + p.ID
	}
	return "v:" + p.ID
}

// Account is the principal's name in budget keys, the ledger and the task
// record: "v_<hash>" or "k_<id>" (characters a budget id allows).
func (p Principal) Account() string {
	if p.Kind == KindKey {
		return "k_" + p.ID
	}
	return "v_" + p.ID
}

// FromAccount is the principal an Account names (without its tier). A task
// record always holds an Account; anything else is taken for a visitor's
// hash, the more limited lane, and shown cut like one.
func FromAccount(account string) Principal {
	if id, ok := strings.CutPrefix(account, "k_"); ok {
		return Principal{Kind: KindKey, ID: id}
	}
	return Principal{Kind: KindVisitor, ID: strings.TrimPrefix(account, "v_")}
}

// String is the principal in logs and alerts: a key's id whole ("k:acme"),
// a visitor's hash cut to its first 12 characters ("v:0123456789ab"), or
// "v:none" for a visitor without one; never an address.
func (p Principal) String() string { return string(p.AppendText(nil)) }

// AppendText appends the String form to b without allocating (the access
// log writes it for every request).
func (p Principal) AppendText(b []byte) []byte {
	if p.Kind == KindKey {
		return append(append(b, "k:"...), p.ID...)
	}
	if p.ID == "" {
		return append(b, "v:none"...)
	}
	return append(append(b, "v:"...), p.ID[:min(len(p.ID), shown)]...)
}

// MetricLabel is the principal in metric labels: a key's id, or "public"
// for every visitor (visitor hashes never become labels).
func (p Principal) MetricLabel() string {
	if p.Kind == KindKey {
		return p.ID
	}
	return PublicTier
}

// Tier is a set of limits shared by the principals of one lane, as the
// policy file defines it and the gate, the runs and the budget apply it.
// The limits apply to each principal on its own, except MaxSiteShare,
// which bounds the tier's principals together.
type Tier struct {
	// Name is the tier's name in the policy.
	Name string
	// TasksPerDay is the tasks one principal may start per UTC day (≥ 1).
	TasksPerDay int64
	// TokensPerDay is the tokens one principal may spend per UTC day (≥ 1).
	TokensPerDay int64
	// TokensPerMinute is the rate of one principal's token bucket; 0 means
	// no bucket.
	TokensPerMinute int64
	// RequestsPerMinute is one principal's sliding window over /api (≥ 1).
	RequestsPerMinute int64
	// RequestsPerSecond is one principal's second window over the same
	// requests; 0 means none.
	RequestsPerSecond int64
	// MaxSiteShare is the share (0 < s ≤ 1) of the site's daily token
	// budget that the tier's principals may use together.
	MaxSiteShare float64
	// TokensPerHour is the tokens one principal may be charged in any
	// sliding hour; 0 means no hourly quota. From SoftAt of it (a share,
	// 0 < s ≤ 1; DefaultSoftAt when unset) the principal is throttled: its
	// request window is held to SoftRequestsPerMinute and its model calls
	// go to the fallback model first.
	TokensPerHour         int64
	SoftAt                float64
	SoftRequestsPerMinute int64
}

// The soft throttle's defaults: a principal is throttled from 80% of its
// hourly tokens, to 5 requests a minute.
const (
	DefaultSoftAt                = 0.8
	DefaultSoftRequestsPerMinute = 5
)

// SoftTokens is the hourly use from which the principal is throttled:
// SoftAt of TokensPerHour rounded down, at least 1; 0 without an hourly
// quota.
func (t Tier) SoftTokens() int64 {
	if t.TokensPerHour <= 0 {
		return 0
	}
	at := t.SoftAt
	if at <= 0 || at > 1 || at != at {
		at = DefaultSoftAt
	}
	return min(max(int64(at*float64(t.TokensPerHour)), 1), t.TokensPerHour)
}

// SoftRequests is the request window a throttled principal is held to:
// SoftRequestsPerMinute, or its default when unset.
func (t Tier) SoftRequests() int64 {
	if t.SoftRequestsPerMinute <= 0 {
		return DefaultSoftRequestsPerMinute
	}
	return t.SoftRequestsPerMinute
}
