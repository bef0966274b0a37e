package api

import (
	"errors"
	"net/http"
	"strconv"
	"time"

	"faregate/protect/budget"
	"faregate/protect/quota"
	"faregate/protect/ratelimit"
)

// The RateLimit policies (draft-ietf-httpapi-ratelimit-headers) faregate
// advertises: tasks per day, tokens per day, requests per minute, tokens
// per minute.
const (
	policyDaily  = "daily"
	policyBudget = "budget"
	policyRPM    = "rpm"
	policyTPM    = "tpm"
	policySpend  = "spend"
)

// rlItem is one policy's quota (q per w seconds) and its state: r left,
// t seconds until that changes.
type rlItem struct {
	name string
	q, w int64
	r, t int64
}

// setRateLimit writes the RateLimit-Policy and RateLimit fields for items,
// as structured-field lists in the same order.
func setRateLimit(h http.Header, items ...rlItem) {
	if len(items) == 0 {
		return
	}
	// One buffer for both fields: the refusal path writes them on every 429.
	var buf [192]byte
	b := buf[:0]
	for i, it := range items {
		if i > 0 {
			b = append(b, ", "...)
		}
		b = append(b, '"')
		b = append(b, it.name...)
		b = append(b, `";q=`...)
		b = strconv.AppendInt(b, max(it.q, 0), 10)
		b = append(b, ";w="...)
		b = strconv.AppendInt(b, it.w, 10)
	}
	split := len(b)
	for i, it := range items {
		if i > 0 {
			b = append(b, ", "...)
		}
		b = append(b, '"')
		b = append(b, it.name...)
		b = append(b, `";r=`...)
		b = strconv.AppendInt(b, max(it.r, 0), 10)
		b = append(b, ";t="...)
		b = strconv.AppendInt(b, max(it.t, 0), 10)
	}
	both := string(b)
	vals := [2]string{both[:split], both[split:]}
	h["Ratelimit-Policy"] = vals[0:1:1]
	h["Ratelimit"] = vals[1:2:2]
}

// rateLimitHeaders names, on a 429, the policy that refused, with the same
// t as the Retry-After it goes with (one rounding rule: ceilSeconds).
func (s *server) rateLimitHeaders(h http.Header, st *state, err error) {
	if err == nil || st == nil {
		return
	}
	if le, ok := err.(*quota.LimitError); ok {
		// The refusal path's own error: no chain to walk.
		setRateLimit(h, rlItem{policyDaily, le.Limit, 86400, 0, ceilSeconds(le.RetryAfter())})
		return
	}
	var (
		le *quota.LimitError
		be *budget.ExhaustedError
		re *ratelimit.RefusedError
		we *ratelimit.WaitTooLongError
	)
	switch {
	case errors.As(err, &le):
		setRateLimit(h, rlItem{policyDaily, le.Limit, 86400, 0, ceilSeconds(le.RetryAfter())})
	case errors.As(err, &be):
		if be.Scope == budget.ScopeTask {
			return // not a rate: the task's own cap
		}
		name, q := s.budgetQuota(st, be.Scope)
		setRateLimit(h, rlItem{name, q, 86400, be.Remaining, ceilSeconds(be.RetryAfter())})
	case errors.As(err, &re):
		switch re.Reason {
		case ratelimit.ReasonRateLimited:
			setRateLimit(h, rlItem{policyRPM, st.tier.RequestsPerMinute, 60, 0, ceilSeconds(re.RetryAfter())})
		case ratelimit.ReasonTokenRateLimited:
			setRateLimit(h, rlItem{policyTPM, st.tier.TokensPerMinute, 60, 0, ceilSeconds(re.RetryAfter())})
		}
	case errors.As(err, &we):
		setRateLimit(h, rlItem{policyTPM, st.tier.TokensPerMinute, 60, 0, ceilSeconds(we.RetryAfter())})
	case errors.Is(err, ratelimit.ErrRateLimited):
		// A window refusal answered again from memory.
		if ra, ok := err.(interface{ RetryAfter() time.Duration }); ok {
			setRateLimit(h, rlItem{policyRPM, st.tier.RequestsPerMinute, 60, 0, ceilSeconds(ra.RetryAfter())})
		}
	}
}

// budgetQuota names the policy of a refusing budget scope and its daily
// quota: tokens ("budget"), or money in micro-units ("spend").
func (s *server) budgetQuota(st *state, scope budget.Scope) (string, int64) {
	switch scope {
	case budget.ScopeSpend:
		return policySpend, s.d.Limits.DailySpendMicro
	case budget.ScopeSite:
		return policyBudget, s.d.Limits.SiteDailyTokens
	case budget.ScopeTier:
		return policyBudget, s.tierTokens(st.tier)
	}
	return policyBudget, st.tier.TokensPerDay
}

// admissionHeaders advertises the principal's policies on a 202: its daily
// tasks and its request window. (A tier's tokens per minute is not among
// them: its remaining would need a read of the bucket on every admission.)
func (s *server) admissionHeaders(h http.Header, st *state, dec quota.Decision) {
	reset := ceilSeconds(dec.Reset.Sub(s.d.Now()))
	items := []rlItem{{policyDaily, st.tier.TasksPerDay, 86400, dec.Remaining, reset}}
	if st.tier.RequestsPerMinute > 0 {
		items = append(items, rlItem{policyRPM, st.tier.RequestsPerMinute, 60, st.window.Remaining, ceilSeconds(st.window.Reset)})
	}
	setRateLimit(h, items...)
}
