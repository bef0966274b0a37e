package api

import (
	"context"
	"encoding/json"
	"errors"
	"math"
	"net/http"
	"time"

	"github.com/go-chi/chi/v5"

	"faregate/agent/task"
	"faregate/protect/aitf"
	"faregate/protect/budget"
	"faregate/protect/plancache"
	"faregate/protect/quota"
	"faregate/protect/ratelimit"
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

func countsOf(p Principal, d quota.Decision) quotaCounts {
	if p.Kind == KindKey {
		return quotaCounts{KeyRemaining: &d.Remaining}
	}
	return quotaCounts{IPRemaining: &d.Remaining, GlobalRemaining: &d.GlobalRemaining}
}

// errModelUnavailable refuses creations while the primary's breaker is
// open and no fallback is configured (503 model_unavailable).
var errModelUnavailable = errors.New("api: model unavailable")

// handleCreateTask is the gate. Its middleware answered the connection
// limit, the body's headers, the key, the refusals known from memory and
// the request window (routes.go); the rest runs here in the contract's
// order, and a request stopped early consumes nothing later in the chain:
// invalid_request → prompt_rejected → AITF delay and Turnstile (public lane)
// → daily task limits → plan cache (always) → model health → token and money
// budget (a cached plan in fallback mode) → token_rate_limited → queue
// bound → the counting script → store → enqueue → 202.
func (s *server) handleCreateTask() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		st := stateOf(r)
		ctx := r.Context()
		req, err := readCreateRequest(r, s.input(), s.promptMax())
		if err != nil {
			if errors.Is(err, ErrInvalid) {
				s.failedCheck(r, st)
			}
			s.writeErr(w, r, err)
			return
		}
		if req.Language == "" {
			req.Language = languageFrom(r.Header.Get("Accept-Language"))
		}
		if rule, bad := st.policy.CheckPrompt(promptTexts(req)...); bad {
			s.failedCheck(r, st)
			s.writeErr(w, r, &PromptRejectedError{Rule: rule})
			return
		}

		if st.principal.Kind == KindVisitor {
			release, err := s.admitAITF(w, r)
			if err != nil {
				if errors.Is(err, aitf.ErrQueueFull) {
					s.writeErr(w, r, err)
				}
				// Otherwise the client left while queued: nobody to answer.
				return
			}
			defer release()
			start := time.Now()
			vctx, end := s.span(ctx, "gate.turnstile")
			err = end(s.d.Verifier.Verify(vctx, req.Token, st.visitor.RemoteIP()))
			s.m.siteverify.WithLabelValues(verifyOutcome(err)).Observe(time.Since(start).Seconds())
			if err != nil {
				if errors.Is(err, turnstile.ErrRejected) {
					s.failedCheck(r, st)
				}
				s.writeErr(w, r, err)
				return
			}
		}

		subj := s.subject(st)
		start := time.Now()
		qctx, end := s.span(ctx, "gate.quota_check")
		_, err = s.d.Quota.Check(qctx, subj)
		end(err)
		s.m.quota.WithLabelValues("check", quotaOutcome(err)).Observe(time.Since(start).Seconds())
		if err != nil {
			s.writeErr(w, r, err)
			return
		}

		cacheReq := plancache.Request{Destination: req.Destination, Days: req.Days, Interests: req.Interests, Language: req.Language}
		if s.cacheMode() == plancache.ModeAlways {
			if s.serveCached(w, r, st, subj, req, cacheReq, nil) {
				return
			}
		}
		if s.d.Models != nil && s.d.Models.Status() == task.ModelUnavailable {
			s.refuseOrCached(w, r, st, subj, req, cacheReq, errModelUnavailable)
			return
		}
		if err := s.affordable(ctx, st, req.Request); err != nil {
			if errors.Is(err, budget.ErrExhausted) {
				s.refuseOrCached(w, r, st, subj, req, cacheReq, err)
				return
			}
			s.writeErr(w, r, err)
			return
		}
		if tpm := st.tier.TokensPerMinute; tpm > 0 {
			minTokens, _ := s.minRun(req.Request)
			ok, wait, err := s.d.Limiter.Peek(ctx, st.principal.Scope(), tpm, minTokens)
			switch {
			case errors.Is(err, ratelimit.ErrTooLarge):
				// The tier's bucket can never hold one run: a policy mistake,
				// answered as the refusal it amounts to.
				s.writeErr(w, r, &ratelimit.RefusedError{Reason: ratelimit.ReasonTokenRateLimited, After: time.Minute})
				return
			case err != nil:
				s.writeErr(w, r, err)
				return
			case !ok:
				s.writeErr(w, r, &ratelimit.RefusedError{Reason: ratelimit.ReasonTokenRateLimited, After: wait})
				return
			}
		}
		if depth, err := s.d.Tasks.Depth(ctx); err != nil {
			s.writeErr(w, r, err)
			return
		} else if depth >= s.d.Limits.QueueMax {
			s.writeErr(w, r, &retryError{ErrServerBusy, retryAfterUnavailable})
			return
		}

		start = time.Now()
		tctx, end := s.span(ctx, "gate.quota_take")
		dec, err := s.d.Quota.Take(tctx, subj)
		end(err)
		s.m.quota.WithLabelValues("take", quotaOutcome(err)).Observe(time.Since(start).Seconds())
		if err != nil {
			s.writeErr(w, r, err)
			return
		}
		rec := s.newRecord(r, st, req)
		// The task must outlive the request: a client that leaves after being
		// counted still gets its task.
		sctx, end := s.span(context.WithoutCancel(ctx), "gate.submit")
		rec, err = s.d.Tasks.Submit(sctx, rec)
		end(err)
		if err != nil {
			s.writeErr(w, r, err)
			return
		}
		s.admitted(w, st, rec, dec)
		writeJSON(w, http.StatusAccepted, createResponse{ID: rec.ID, Status: rec.Status, Quota: countsOf(st.principal, dec)})
	})
}

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
		},
	}
	if res, ok := aitf.FromContext(r.Context()); ok {
		rec.AITF = task.AITFTrace{Score: res.Score, Vector: res.Vector[:], Degraded: res.Degraded}
	}
	return rec
}

// tierTokens is the tier's share of the site's daily tokens, 0 when it may
// use all of it (no tier scope is then kept).
func (s *server) tierTokens(t Tier) int64 {
	if t.MaxSiteShare <= 0 || t.MaxSiteShare >= 1 {
		return 0
	}
	return max(int64(math.Floor(t.MaxSiteShare*float64(s.d.Limits.SiteDailyTokens))), 1)
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

// affordable is the admission's budget check: can the principal, its tier
// and the site afford one minimal run of req, in tokens and in money.
func (s *server) affordable(ctx context.Context, st *state, req task.Request) error {
	if s.d.Budget == nil {
		return nil
	}
	tierTokens := s.tierTokens(st.tier)
	tier := ""
	if tierTokens > 0 {
		tier = st.tier.Name
	}
	tokens, cost := s.minRun(req)
	ctx, end := s.span(ctx, "gate.budget")
	return end(s.d.Budget.CanAfford(ctx, budget.AffordRequest{
		Day: quota.Day(s.d.Now()), Principal: st.principal.Account(), PrincipalLimit: st.tier.TokensPerDay,
		Tier: tier, TierLimit: tierTokens, Tokens: tokens, CostMicro: cost,
	}))
}

func (s *server) cacheMode() plancache.Mode {
	if s.d.PlanCache == nil {
		return plancache.ModeOff
	}
	return s.d.PlanCacheMode
}

// refuseOrCached answers a refusal of the model or the budget with a cached
// plan for the same request in fallback mode, else with the refusal.
func (s *server) refuseOrCached(w http.ResponseWriter, r *http.Request, st *state, subj quota.Subject, req createRequest, cr plancache.Request, refusal error) {
	if s.cacheMode() == plancache.ModeFallback && s.serveCached(w, r, st, subj, req, cr, refusal) {
		return
	}
	s.writeErr(w, r, refusal)
}

// serveCached answers with a plan cached for the same normalised request:
// the task is counted like any other (the quota moves), spends no tokens,
// and is stored already succeeded with result.cached set. It reports false
// when there is no such plan (or the cache cannot be read); the caller then
// goes on as without a cache. A refusal of the quota is answered here.
func (s *server) serveCached(w http.ResponseWriter, r *http.Request, st *state, subj quota.Subject, req createRequest, cr plancache.Request, refusal error) bool {
	if req.Prompt != "" {
		// Plans are cached for trips; a prompt's answer is never shared.
		return false
	}
	ctx := r.Context()
	plan, ok, err := s.d.PlanCache.Get(ctx, cr)
	if err != nil || !ok {
		return false
	}
	var res task.Result
	if err := json.Unmarshal(plan.Result, &res); err != nil {
		return false
	}
	tctx, end := s.span(ctx, "gate.quota_take")
	dec, err := s.d.Quota.Take(tctx, subj)
	end(err)
	if err != nil {
		s.writeErr(w, r, err)
		return true
	}
	res.Cached = true
	rec := s.newRecord(r, st, req)
	rec.Result = &res
	rec, err = s.d.Tasks.Cached(context.WithoutCancel(ctx), rec)
	if err != nil {
		s.writeErr(w, r, err)
		return true
	}
	s.m.cached.Inc()
	s.admitted(w, st, rec, dec)
	writeJSON(w, http.StatusAccepted, createResponse{ID: rec.ID, Status: rec.Status, Quota: countsOf(st.principal, dec)})
	return true
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
