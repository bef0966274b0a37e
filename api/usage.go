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

// usageResponse is GET /api/usage: a key's tier, limits and today's use.
type usageResponse struct {
	Principal usagePrincipal `json:"principal"`
	Tier      string         `json:"tier"`
	Day       string         `json:"day"`
	Limits    usageLimits    `json:"limits"`
	Used      usageCounts    `json:"used"`
	Remaining usageCounts    `json:"remaining"`
}

type usagePrincipal struct {
	Kind string `json:"kind"`
	ID   string `json:"id"`
}

type usageLimits struct {
	TasksPerDay       int64   `json:"tasks_per_day"`
	TokensPerDay      int64   `json:"tokens_per_day"`
	TokensPerMinute   int64   `json:"tokens_per_minute"`
	RequestsPerMinute int64   `json:"requests_per_minute"`
	MaxSiteShare      float64 `json:"max_site_share"`
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
		writeJSON(w, http.StatusOK, usageResponse{
			Principal: usagePrincipal{Kind: principal.KindKey, ID: st.principal.ID},
			Tier:      st.tier.Name,
			Day:       day,
			Limits: usageLimits{TasksPerDay: st.tier.TasksPerDay, TokensPerDay: st.tier.TokensPerDay,
				TokensPerMinute: st.tier.TokensPerMinute, RequestsPerMinute: st.tier.RequestsPerMinute, MaxSiteShare: share},
			Used:      usageCounts{Tasks: st.tier.TasksPerDay - dec.Remaining, Tokens: usedTokens},
			Remaining: usageCounts{Tasks: dec.Remaining, Tokens: max(st.tier.TokensPerDay-usedTokens, 0)},
		})
	})
}
