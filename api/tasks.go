package api

import (
	"context"
	"errors"
	"math"
	"net/http"

	"github.com/go-chi/chi/v5"

	"faregate/agent/plancache"
	"faregate/agent/task"
	"faregate/protect/aitf"
	"faregate/protect/budget"
	"faregate/protect/principal"
	"faregate/protect/quota"
	"faregate/protect/turnstile"
)

// createResponse is the 202 body.
type createResponse struct {
	ID     string      `json:"id"`
	Status string      `json:"status"`
	Quota  quotaCounts `json:"quota"`
}

// quotaCounts are the tasks left today: a visitor's own and the site's, or
// a key's own.
type quotaCounts struct {
	IPRemaining     *int64 `json:"ip_remaining,omitempty"`
	GlobalRemaining *int64 `json:"global_remaining,omitempty"`
	KeyRemaining    *int64 `json:"key_remaining,omitempty"`
}

func countsOf(p principal.Principal, d quota.Decision) quotaCounts {
	if p.Kind == principal.KindKey {
		return quotaCounts{KeyRemaining: &d.Remaining}
	}
	return quotaCounts{IPRemaining: &d.Remaining, GlobalRemaining: &d.GlobalRemaining}
}

// errModelUnavailable refuses creations while the primary's breaker is
// open and no fallback is configured (503 model_unavailable).
var errModelUnavailable = errors.New("api: model unavailable")

// admitted records an admission for the log line, the metrics and the
// RateLimit headers of the principal's policies.
func (s *server) admitted(w http.ResponseWriter, st *state, rec task.Record, dec quota.Decision) {
	st.admitted = rec.ID
	s.m.admissions.WithLabelValues(st.principal.MetricLabel()).Inc()
	s.admissionHeaders(w.Header(), st, dec)
	w.Header().Set("Location", "/api/tasks/"+rec.ID)
}

// newRecord is the stored form of an admitted request: the principal, the
// limits of its tier as admitted (the run keeps them whatever a reload does
// meanwhile) and what AITF said.
func (s *server) newRecord(r *http.Request, st *state, req createRequest) task.Record {
	rec := task.Record{
		Task:      task.Task{Request: req.Request},
		Principal: st.principal.Account(),
		Tier:      st.tier.Name,
		Day:       quota.Day(s.d.Now()),
		RequestID: st.id,
		Limits: task.Limits{
			TokensPerDay:    st.tier.TokensPerDay,
			TokensPerMinute: st.tier.TokensPerMinute,
			TierTokens:      s.tierTokens(st.tier),
			TokensPerHour:   st.tier.TokensPerHour,
			SoftTokens:      st.tier.SoftTokens(),
		},
	}
	if res, ok := aitf.FromContext(r.Context()); ok {
		rec.AITF = task.AITFTrace{Score: res.Score, Vector: res.Vector[:], Degraded: res.Degraded}
	}
	return rec
}

// tierTokens is the tier's share of the site's daily tokens, 0 when it may
// use all of it (no tier scope is then kept).
func (s *server) tierTokens(t principal.Tier) int64 {
	if t.MaxSiteShare <= 0 || t.MaxSiteShare >= 1 {
		return 0
	}
	return max(int64(math.Floor(t.MaxSiteShare*float64(s.d.Limits.SiteDailyTokens))), 1)
}

// affordable asks the budget whether the principal, its tier and the site
// can afford tokens and costMicro (money micro-units) today. Admission asks
// for one minimal run (checkBudget); a route that governs one model call
// would ask for that call's reservation.
func (s *server) affordable(ctx context.Context, st *state, tokens, costMicro int64) error {
	if s.d.Budget == nil {
		return nil
	}
	tierTokens := s.tierTokens(st.tier)
	tier := ""
	if tierTokens > 0 {
		tier = st.tier.Name
	}
	ctx, end := s.span(ctx, "gate.budget")
	return end(s.d.Budget.CanAfford(ctx, budget.AffordRequest{
		Day: quota.Day(s.d.Now()), Principal: st.principal.Account(), PrincipalLimit: st.tier.TokensPerDay,
		Tier: tier, TierLimit: tierTokens, Tokens: tokens, CostMicro: costMicro,
	}))
}

func (s *server) cacheMode() plancache.Mode {
	if s.d.PlanCache == nil {
		return plancache.ModeOff
	}
	return s.d.PlanCacheMode
}

func verifyOutcome(err error) string {
	switch {
	case err == nil:
		return "accepted"
	case errors.Is(err, turnstile.ErrRejected):
		return "rejected"
	}
	return "unavailable"
}

func quotaOutcome(err error) string {
	switch {
	case err == nil:
		return "allowed"
	case errors.Is(err, quota.ErrUnavailable):
		return "unavailable"
	}
	return "denied"
}

// handleGetTask answers GET /api/tasks/{id}.
func (s *server) handleGetTask() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec, err := s.d.Store.Get(r.Context(), chi.URLParam(r, "id"))
		if err != nil {
			s.writeErr(w, r, err)
			return
		}
		writeJSON(w, http.StatusOK, rec.Task)
	})
}

// configResponse is GET /api/config.
type configResponse struct {
	TurnstileSiteKey   string     `json:"turnstile_site_key"`
	TurnstileScriptURL string     `json:"turnstile_script_url"`
	TurnstileTest      bool       `json:"turnstile_test"`
	DevMode            bool       `json:"dev_mode"`
	ModelStatus        string     `json:"model_status"`
	OfflineModel       bool       `json:"offline_model"`
	Input              string     `json:"input"`
	Limits             limitsBody `json:"limits"`
	Languages          []string   `json:"languages"`
}

// limitsBody is /api/config's limits: the daily and per-minute counts, and
// the bounds of both request forms' fields (the page checks them before
// spending a Turnstile token).
type limitsBody struct {
	IPDaily           int64 `json:"ip_daily"`
	GlobalDaily       int64 `json:"global_daily"`
	RequestsPerMinute int64 `json:"requests_per_minute"`
	PromptMaxChars    int   `json:"prompt_max_chars"`
	DestinationMax    int   `json:"destination_max"`
	DaysMin           int   `json:"days_min"`
	DaysMax           int   `json:"days_max"`
	InterestsMax      int   `json:"interests_max"`
	InterestMax       int   `json:"interest_max"`
}

func (s *server) handleConfig() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		status, offline := task.ModelOK, false
		if s.d.Models != nil {
			status, offline = s.d.Models.Status(), s.d.Models.Offline()
		}
		pub := stateOf(r).policy.Public()
		writeJSON(w, http.StatusOK, configResponse{
			TurnstileSiteKey:   s.d.Config.TurnstileSiteKey,
			TurnstileScriptURL: s.d.Config.TurnstileScriptURL,
			TurnstileTest:      s.d.Config.TurnstileTest,
			DevMode:            s.d.Config.DevMode,
			ModelStatus:        status,
			OfflineModel:       offline,
			Input:              s.input(),
			Limits: limitsBody{IPDaily: pub.TasksPerDay, GlobalDaily: s.d.Limits.GlobalDailyTasks, RequestsPerMinute: pub.RequestsPerMinute,
				PromptMaxChars: s.promptMax(), DestinationMax: destinationMax, DaysMin: daysMin, DaysMax: daysMax,
				InterestsMax: interestsMax, InterestMax: interestMax},
			Languages: []string{task.LangEnglish, task.LangChinese},
		})
	})
}

// minRun is one minimal run of req in tokens and money: the request's own
// with an external agent (Deps.MinRun), else the built-in planner's fixed
// reservation of a first call.
func (s *server) minRun(req task.Request) (tokens, costMicro int64) {
	if s.d.MinRun != nil {
		return s.d.MinRun(req)
	}
	return s.d.MinRunTokens, s.d.MinRunCost
}

// promptMax is the longest prompt, in code points.
func (s *server) promptMax() int {
	if n := s.d.Config.PromptMaxChars; n > 0 {
		return n
	}
	return DefaultPromptMaxChars
}

// input is the request form the server takes.
func (s *server) input() string {
	if s.d.Config.Input == InputPrompt {
		return InputPrompt
	}
	return InputTrip
}
