package api

import (
	"errors"
	"net/http"

	"faregate/protect/budget"
	"faregate/protect/principal"
	"faregate/protect/quota"
)

// errNoKey answers GET /api/usage without an API key: usage is per key.
var errNoKey = errors.New("api: usage needs an API key")

// usageResponse is GET /api/usage: a key's tier, limits and today's use;
// with an hourly quota, the last hour's use and whether the key is
// throttled (past the soft share: its request window is the soft one, its
// model calls go to the fallback model first).
type usageResponse struct {
	Principal usagePrincipal `json:"principal"`
	Tier      string         `json:"tier"`
	Day       string         `json:"day"`
	Limits    usageLimits    `json:"limits"`
	Used      usageCounts    `json:"used"`
	Remaining usageCounts    `json:"remaining"`
	Throttled bool           `json:"throttled"`
	Hour      *usageHour     `json:"hour,omitempty"`
}

// usageHour is the sliding hour's tokens: charged, and held by calls in
// flight.
type usageHour struct {
	Tokens     int64 `json:"tokens"`
	Remaining  int64 `json:"remaining"`
	SoftTokens int64 `json:"soft_tokens"`
}

type usagePrincipal struct {
	Kind string `json:"kind"`
	ID   string `json:"id"`
}

type usageLimits struct {
	TasksPerDay           int64   `json:"tasks_per_day"`
	TokensPerDay          int64   `json:"tokens_per_day"`
	TokensPerMinute       int64   `json:"tokens_per_minute"`
	RequestsPerMinute     int64   `json:"requests_per_minute"`
	RequestsPerSecond     int64   `json:"requests_per_second"`
	TokensPerHour         int64   `json:"tokens_per_hour"`
	SoftAt                float64 `json:"soft_at,omitempty"`
	SoftRequestsPerMinute int64   `json:"soft_requests_per_minute,omitempty"`
	MaxSiteShare          float64 `json:"max_site_share"`
}

type usageCounts struct {
	Tasks  int64 `json:"tasks"`
	Tokens int64 `json:"tokens"`
}

// handleUsage answers a key's own limits and today's use. It reads; it
// never counts anything but the request window.
func (s *server) handleUsage() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		st := stateOf(r)
		if st.principal.Kind != principal.KindKey {
			s.writeErr(w, r, errNoKey)
			return
		}
		ctx := r.Context()
		day := quota.Day(s.d.Now())
		dec, err := s.d.Quota.Check(ctx, s.subject(st))
		var le *quota.LimitError
		if err != nil && !errors.As(err, &le) {
			s.writeErr(w, r, err)
			return
		}
		var rep budget.UsageReport
		if s.d.Budget != nil {
			if rep, err = s.d.Budget.Usage(ctx, budget.UsageQuery{Day: day, Principal: st.principal.Account(), PrincipalLimit: st.tier.TokensPerDay}); err != nil {
				s.writeErr(w, r, err)
				return
			}
		}
		usedTokens := rep.Principal.Settled + rep.Principal.Outstanding
		share := st.tier.MaxSiteShare
		if share <= 0 {
			share = 1
		}
		out := usageResponse{
			Principal: usagePrincipal{Kind: principal.KindKey, ID: st.principal.ID},
			Tier:      st.tier.Name,
			Day:       day,
			Limits: usageLimits{TasksPerDay: st.tier.TasksPerDay, TokensPerDay: st.tier.TokensPerDay,
				TokensPerMinute: st.tier.TokensPerMinute, RequestsPerMinute: st.tier.RequestsPerMinute,
				RequestsPerSecond: st.tier.RequestsPerSecond, TokensPerHour: st.tier.TokensPerHour, MaxSiteShare: share},
			Used:      usageCounts{Tasks: st.tier.TasksPerDay - dec.Remaining, Tokens: usedTokens},
			Remaining: usageCounts{Tasks: dec.Remaining, Tokens: max(st.tier.TokensPerDay-usedTokens, 0)},
		}
		if t := st.tier; t.TokensPerHour > 0 {
			// The request window read the hour in its own round trip.
			out.Limits.SoftAt, out.Limits.SoftRequestsPerMinute = t.SoftAt, t.SoftRequests()
			if out.Limits.SoftAt <= 0 {
				out.Limits.SoftAt = principal.DefaultSoftAt
			}
			out.Throttled = st.window.Soft
			out.Hour = &usageHour{Tokens: st.window.HourUsed, Remaining: max(t.TokensPerHour-st.window.HourUsed, 0), SoftTokens: t.SoftTokens()}
		}
		writeJSON(w, http.StatusOK, out)
	})
}
