package api

import (
	"errors"
	"math"
	"net/http"
	"strconv"

	"faregate/protect/budget"
	"faregate/protect/codes"
	"faregate/protect/quota"
	"faregate/protect/ratelimit"
)

// The RateLimit policies (draft-ietf-httpapi-ratelimit-headers) faregate
// advertises: tasks per day, tokens per day, money per day, requests per
// minute, requests per second, the soft requests per minute of a
// principal near its hourly tokens, tokens per hour, tokens per minute,
// failed checks per hour, the invalid ratio over 10 minutes (its q the
// ratio in percent), input spikes per hour, and concurrent event streams.
// Every 429 names one of them.
const (
	policyDaily   = "daily"
	policyBudget  = "budget"
	policyRPM     = "rpm"
	policyRPS     = "rps"
	policySoft    = "soft"
	policyHour    = "hour"
	policyTPM     = "tpm"
	policySpend   = "spend"
	policyFailed  = "failed"
	policyInvalid = "invalid"
	policyAnomaly = "anomaly"
	policyStreams = "streams"
)

// unitConcurrent is the draft's quota unit for a limit on requests at once
// (a stream cap has no window).
const unitConcurrent = `"concurrent-requests"`

// rlItem is one policy's quota (q per w seconds; w 0: no window, then unit
// says what q counts) and its state: r left, t seconds until that changes.
type rlItem struct {
	name string
	q, w int64
	r, t int64
	unit string
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
		if it.w > 0 {
			b = append(b, ";w="...)
			b = strconv.AppendInt(b, it.w, 10)
		}
		if it.unit != "" {
			b = append(b, ";qu="...)
			b = append(b, it.unit...)
		}
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

// rateLimitHeaders names, on a 429 with code, the policy that refused. Its
// t is the Retry-After the answer carries (secs), so the two cannot differ;
// the policy follows from the code, so no 429 goes without one.
func (s *server) rateLimitHeaders(h http.Header, st *state, code string, err error, secs int64) {
	if st == nil {
		return
	}
	switch code {
	case codes.DemoIPLimitReached, codes.DemoGlobalLimitReached, codes.KeyDailyLimitReached:
		q := st.tier.TasksPerDay
		if le, ok := err.(*quota.LimitError); ok {
			// The refusal path's own error: no chain to walk (and no
			// allocation for errors.As's target).
			q = le.Limit
		} else if l, ok := wrappedLimit(err); ok {
			q = l
		} else if code == codes.DemoGlobalLimitReached {
			q = s.d.Limits.GlobalDailyTasks
		}
		setRateLimit(h, rlItem{name: policyDaily, q: q, w: 86400, t: secs})
	case codes.DemoBudgetExhausted:
		if re := refusedOf(err); re != nil && re.Reason == ratelimit.ReasonHourExhausted {
			q := st.tier.TokensPerHour
			if re.Quota > 0 {
				q = re.Quota // a model call's: the task's principal, not this request's tier
			}
			setRateLimit(h, rlItem{name: policyHour, q: q, w: 3600, t: secs})
			return
		}
		var be *budget.ExhaustedError
		if !errors.As(err, &be) {
			setRateLimit(h, rlItem{name: policyBudget, q: s.d.Limits.SiteDailyTokens, w: 86400, t: secs})
			return
		}
		name, q := s.budgetQuota(st, be.Scope)
		setRateLimit(h, rlItem{name: name, q: q, w: 86400, r: be.Remaining, t: secs})
	case codes.RateLimited:
		it := rlItem{name: policyRPM, q: st.tier.RequestsPerMinute, w: 60, t: secs}
		if re := refusedOf(err); re != nil {
			switch re.Window {
			case ratelimit.WindowSecond:
				it = rlItem{name: policyRPS, q: st.tier.RequestsPerSecond, w: 1, t: secs}
			case ratelimit.WindowSoft:
				it = rlItem{name: policySoft, q: st.tier.SoftRequests(), w: 60, t: secs}
			}
		}
		setRateLimit(h, it)
	case codes.InvalidRatio:
		setRateLimit(h, rlItem{name: policyInvalid, q: int64(math.Round(s.d.Limits.InvalidRatio * 100)), w: 600, t: secs})
	case codes.TokenRateLimited:
		setRateLimit(h, rlItem{name: policyTPM, q: st.tier.TokensPerMinute, w: 60, t: secs})
	case codes.TooManyFailedChecks:
		setRateLimit(h, rlItem{name: policyFailed, q: s.d.Limits.FailedChecksPerHour, w: 3600, t: secs})
	case codes.AnomalyBlocked:
		setRateLimit(h, rlItem{name: policyAnomaly, q: ratelimit.AnomalyThreshold, w: 3600, t: secs})
	case codes.TooManyStreams:
		setRateLimit(h, rlItem{name: policyStreams, q: int64(s.d.Limits.StreamsPerPrincipal), unit: unitConcurrent, t: secs})
	case codes.EventLimit, codes.ToolLimit, codes.StepLimit, codes.InputSpike, codes.TooManyCalls:
		// A task's own limit (v1.go): it lasts as long as the task.
		setRateLimit(h, rlItem{name: policyTask, q: limitOf(err), w: secs, t: secs})
	}
}

// wrappedLimit is the limit of a quota refusal deeper in err's chain.
func wrappedLimit(err error) (int64, bool) {
	var le *quota.LimitError
	if errors.As(err, &le) {
		return le.Limit, true
	}
	return 0, false
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
// tasks and its request window (the soft one while it is throttled). (A
// tier's tokens per minute and per hour are not among them: when either
// frees up depends on the calls in flight, which the gate does not read.)
func (s *server) admissionHeaders(h http.Header, st *state, dec quota.Decision) {
	reset := ceilSeconds(dec.Reset.Sub(s.d.Now()))
	items := []rlItem{{name: policyDaily, q: st.tier.TasksPerDay, w: 86400, r: dec.Remaining, t: reset}}
	if st.tier.RequestsPerMinute > 0 {
		it := rlItem{name: policyRPM, q: st.tier.RequestsPerMinute, w: 60, r: st.window.Remaining, t: ceilSeconds(st.window.Reset)}
		if soft := st.tier.SoftRequests(); st.window.Soft && soft < it.q {
			it.name, it.q = policySoft, soft
		}
		items = append(items, it)
	}
	setRateLimit(h, items...)
}
