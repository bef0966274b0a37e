package api

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"time"

	"faregate/agent/plancache"
	"faregate/agent/task"
	"faregate/protect/aitf"
	"faregate/protect/budget"
	"faregate/protect/principal"
	"faregate/protect/quota"
	"faregate/protect/ratelimit"
	"faregate/protect/turnstile"
)

// Admission as data: POST /api/tasks is one ordered list of named checks
// (createChecks), run by one loop (run) and ended by one admission tail
// (storeAndAnswer). The list is the order; README.md's "How a task is
// admitted" and the OpenAPI description of POST /api/tasks are tested
// against its names (admission_test.go), so none of the three can drift.
//
// Adding a check: write one function with the check signature,
// func(*admission) error, and put one entry in createChecks where the
// manual places it (then the README line and the OpenAPI sentence the
// test asks for). A check returns nil to go on, or the error to refuse with
// (the error table picks status and code); it never writes the answer.
//
// Reuse by other routes: a check reads only the admission, so a route with
// another body builds its own list from the pieces that apply to it, and
// its own tail, and runs them with the same loop (s.admit). The pieces a
// check wraps take the request's state and their sizes as arguments, so a
// route whose unit is not "one minimal run" calls them with its own: the
// /v1 model routes of bring-your-own-agent take the principal from the key
// (the principal middleware, gate.go), then list a budget check calling
// s.affordable and a pacing check calling s.paced with the call's
// reservation (checkBudget and checkPacing pass MinRunTokens), and leave
// out what the manual says /v1 skips (window, AITF, Turnstile, the daily
// task limits, the plan cache).

// check is one named step of an admission.
type check struct {
	// name is the step as the README's numbered list and the OpenAPI
	// description name it.
	name string
	run  func(*admission) error
	// public: only anonymous visitors meet it (a key has declared itself).
	public bool
	// quiet: the step refuses nothing of its own (it prepares the request
	// for the checks after it), so the documents do not list it.
	quiet bool
	// fallback is the refusal a cached plan may answer instead, in the
	// plan cache's fallback mode.
	fallback error
	// resume marks where a served cached plan rejoins the order: it skips
	// what only a run needs, but is counted like any task.
	resume bool
}

// admission is one POST /api/tasks on its way through the checks: what the
// checks before learned, for the ones after.
type admission struct {
	w  http.ResponseWriter
	r  *http.Request
	st *state
	// req is the validated body (from the body check on).
	req createRequest
	// dec is the counting script's decision (for the tail).
	dec quota.Decision
	// plan is a cached plan that answers instead of a run.
	plan *task.Result
	// list is the order being run; next the index after the running check
	// (for a check that runs the rest inside a wrapper of its own).
	list []check
	next int
	tail func(*admission)
	// cleanup runs when the request is answered (deadline, AITF slot).
	cleanup []func()
}

// Outcomes of a check that are not refusals.
var (
	// errGone: the client left while waiting; nobody to answer.
	errGone = errors.New("api: client gone")
	// errContinued: the check ran the rest of the order itself.
	errContinued = errors.New("api: admission continued inside a check")
	// errServeCached: a cached plan answers; resume at the counting script.
	errServeCached = errors.New("api: a cached plan answers")
)

// frontSteps are the steps of the order that every /api request meets
// before its route (front in middleware.go; bodyShape and principal in
// gate.go): they are the order's first, but run for every route.
func frontSteps() []string {
	return []string{"connection limit", "shape from the headers", "API key"}
}

// tailStep names what storeAndAnswer does.
const tailStep = "the task is stored and put on the queue"

// createChecks is the order of POST /api/tasks after the front steps: the
// project's (third round), one entry per step.
func (s *server) createChecks() []check {
	return []check{
		{name: "refusals known from memory", run: s.checkRemembered},
		{name: "request deadline", run: s.checkDeadline, quiet: true},
		{name: "request window", run: s.checkWindow},
		{name: "AITF score", run: s.checkAITFScore, quiet: true},
		{name: "body", run: s.checkBody},
		{name: "static prompt rules", run: s.checkPromptRules},
		{name: "AITF delay", run: s.checkAITFDelay, public: true},
		{name: "Turnstile", run: s.checkTurnstile, public: true},
		{name: "daily task limits", run: s.checkDailyLimits},
		{name: "plan cache", run: s.checkPlanCache},
		{name: "model health", run: s.checkModelHealth, fallback: errModelUnavailable},
		{name: "token and money budget", run: s.checkBudget, fallback: budget.ErrExhausted},
		{name: "tokens per minute", run: s.checkPacing},
		{name: "queue bound", run: s.checkQueueBound},
		{name: "the counting script", run: s.checkCount, resume: true},
	}
}

// admissionOrder is every step of POST /api/tasks the documents list, in
// order: the front steps, the checks that can refuse, the tail.
func (s *server) admissionOrder() []string {
	out := frontSteps()
	for _, c := range s.createChecks() {
		if !c.quiet {
			out = append(out, c.name)
		}
	}
	return append(out, tailStep)
}

// admit runs list, in order, for each request, then tail: the one loop of
// an admission.
func (s *server) admit(list []check, tail func(*admission)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		st := stateOf(r)
		st.adm = admission{w: w, r: r, st: st, list: list, tail: tail}
		a := &st.adm
		defer func() {
			for i := len(a.cleanup) - 1; i >= 0; i-- {
				a.cleanup[i]()
			}
		}()
		if s.run(a, 0) {
			a.tail(a)
		}
	})
}

// run runs a.list from index from and reports whether the request passed
// every check (false: it was answered, continued inside a check, or its
// client left). A refusal is answered here, once: a 400 or 403 also counts
// as a failed check of the visitor and as an invalid request of the
// principal (failedCheck).
func (s *server) run(a *admission, from int) bool {
	for i := from; i < len(a.list); i++ {
		c := a.list[i]
		if c.public && a.st.principal.Kind != principal.KindVisitor {
			continue
		}
		a.next = i + 1
		err := c.run(a)
		if err == nil {
			continue
		}
		if err == errServeCached || c.fallback != nil && errors.Is(err, c.fallback) &&
			s.cacheMode() == plancache.ModeFallback && s.cachedPlan(a) {
			i = resumeAt(a.list) - 1
			continue
		}
		switch err {
		case errGone:
			return false
		case errContinued:
			return false
		}
		if st := s.errors.lookup(err).status; st == http.StatusBadRequest || st == http.StatusForbidden {
			s.failedCheck(a.r, a.st)
		}
		s.writeErr(a.w, a.r, err)
		return false
	}
	return true
}

// resumeAt is the index of the check a served cached plan resumes at.
func resumeAt(list []check) int {
	for i, c := range list {
		if c.resume {
			return i
		}
	}
	return len(list)
}

// checkRemembered: a principal (or the site) already over a daily task
// limit, a visitor over its failed-check limit, a principal over the
// invalid ratio, a principal blocked for input spikes. No Redis call, and
// not counted by the request window: a flood of these costs nothing.
func (s *server) checkRemembered(a *admission) error {
	if err := s.d.Quota.Remembered(s.subject(a.st)); err != nil {
		return err
	}
	return s.memo.refusal(a.st.principal)
}

// checkDeadline gives the rest of the admission RequestTimeout (see
// deadline, routes.go); after the refusals from memory, so those cost no
// timer.
func (s *server) checkDeadline(a *admission) error {
	if d := s.d.Limits.RequestTimeout; d > 0 {
		ctx, cancel := context.WithTimeout(a.r.Context(), d)
		a.r = a.r.WithContext(ctx)
		a.cleanup = append(a.cleanup, cancel)
	}
	return nil
}

// checkWindow is the request window, with the failed-check log, the
// invalid ratio and the anomaly block in the same round trip.
func (s *server) checkWindow(a *admission) error { return s.windowCheck(a.r, a.st, true) }

// checkAITFScore scores the body for agent-workflow signals (the guard's
// middleware, which wraps what comes after it: the rest of the order runs
// inside it).
func (s *server) checkAITFScore(a *admission) error {
	if s.d.AITF == nil {
		return nil
	}
	s.d.AITF.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a.w, a.r = w, r
		if s.run(a, a.next) {
			a.tail(a)
		}
	})).ServeHTTP(a.w, a.r)
	return errContinued
}

// checkBody reads and validates the body; the plan language defaults from
// Accept-Language.
func (s *server) checkBody(a *admission) error {
	req, err := readCreateRequest(a.r, s.input(), s.promptMax())
	if err != nil {
		return err
	}
	if req.Language == "" {
		req.Language = languageFrom(a.r.Header.Get("Accept-Language"))
	}
	a.req = req
	return nil
}

// checkPromptRules applies the policy's static prompt rules.
func (s *server) checkPromptRules(a *admission) error {
	if rule, bad := a.st.policy.CheckPrompt(promptTexts(a.req)...); bad {
		return &PromptRejectedError{Rule: rule}
	}
	return nil
}

// checkAITFDelay holds a public creation in the AITF delay queue (enforce
// mode) until the request is answered.
func (s *server) checkAITFDelay(a *admission) error {
	release, err := s.admitAITF(a.w, a.r)
	if err != nil {
		if errors.Is(err, aitf.ErrQueueFull) {
			return err
		}
		return errGone // the client left while queued
	}
	a.cleanup = append(a.cleanup, release)
	return nil
}

// checkTurnstile asks siteverify about the visitor's token.
func (s *server) checkTurnstile(a *admission) error {
	start := time.Now()
	ctx, end := s.span(a.r.Context(), "gate.turnstile")
	err := end(s.d.Verifier.Verify(ctx, a.req.Token, a.st.visitor.RemoteIP()))
	s.m.siteverify.WithLabelValues(verifyOutcome(err)).Observe(time.Since(start).Seconds())
	if err == nil || errors.Is(err, turnstile.ErrRejected) {
		s.deps.turnstile.ok() // siteverify answered
	}
	return err
}

// checkDailyLimits reads the daily task limits (the visitor's and the
// site's, or the key's) without counting.
func (s *server) checkDailyLimits(a *admission) error {
	start := time.Now()
	ctx, end := s.span(a.r.Context(), "gate.quota_check")
	_, err := s.d.Quota.Check(ctx, s.subject(a.st))
	end(err)
	s.m.quota.WithLabelValues("check", quotaOutcome(err)).Observe(time.Since(start).Seconds())
	return err
}

// checkPlanCache answers with a cached plan first, in always mode.
func (s *server) checkPlanCache(a *admission) error {
	if s.cacheMode() == plancache.ModeAlways && s.cachedPlan(a) {
		return errServeCached
	}
	return nil
}

// checkModelHealth refuses while the primary's breaker is open and no
// fallback is configured.
func (s *server) checkModelHealth(a *admission) error {
	if s.d.Models != nil && s.d.Models.Status() == task.ModelUnavailable {
		return errModelUnavailable
	}
	return nil
}

// checkBudget: can the principal, its tier and the site afford one
// minimal run, in tokens and in money, today; and the principal's
// sliding hour, when its tier has one.
func (s *server) checkBudget(a *admission) error {
	tokens, cost := s.minRun(a.req.Request)
	if err := s.affordable(a.r.Context(), a.st, tokens, cost); err != nil {
		return err
	}
	return s.hourRoom(a.r.Context(), a.st, tokens)
}

// checkPacing: the tier's tokens-per-minute bucket must hold one minimal
// run.
func (s *server) checkPacing(a *admission) error {
	tokens, _ := s.minRun(a.req.Request)
	return s.paced(a.r.Context(), a.st, tokens)
}

// paced refuses while the principal's tokens-per-minute bucket cannot hold
// need tokens (no bucket: never). Admission asks for one minimal run; a
// route that governs one model call would ask for that call's reservation.
func (s *server) paced(ctx context.Context, st *state, need int64) error {
	tpm := st.tier.TokensPerMinute
	if tpm <= 0 {
		return nil
	}
	ok, wait, err := s.d.Limiter.Peek(ctx, st.principal.Scope(), tpm, need)
	switch {
	case errors.Is(err, ratelimit.ErrTooLarge):
		// The tier's bucket can never hold need: a policy mistake,
		// answered as the refusal it amounts to.
		return &ratelimit.RefusedError{Reason: ratelimit.ReasonTokenRateLimited, After: time.Minute}
	case err != nil:
		return err
	case !ok:
		return &ratelimit.RefusedError{Reason: ratelimit.ReasonTokenRateLimited, After: wait}
	}
	return nil
}

// checkQueueBound refuses while QueueMax tasks wait or run.
func (s *server) checkQueueBound(a *admission) error {
	depth, err := s.d.Tasks.Depth(a.r.Context())
	if err != nil {
		return err
	}
	if depth >= s.d.Limits.QueueMax {
		return &retryError{ErrServerBusy, retryAfterUnavailable}
	}
	return nil
}

// checkCount is the counting script: the one Lua call that checks and
// takes the daily task limits, idempotently. Past it the task counts.
func (s *server) checkCount(a *admission) error {
	start := time.Now()
	ctx, end := s.span(a.r.Context(), "gate.quota_take")
	dec, err := s.d.Quota.Take(ctx, s.subject(a.st))
	end(err)
	s.m.quota.WithLabelValues("take", quotaOutcome(err)).Observe(time.Since(start).Seconds())
	a.dec = dec
	return err
}

// storeAndAnswer is the one admission tail: the counted task is stored
// (and queued, or final at once for a served cached plan) and answered 202.
// The task must outlive the request: a client that leaves after being
// counted still gets its task.
func (s *server) storeAndAnswer(a *admission) {
	rec := s.newRecord(a.r, a.st, a.req)
	ctx, end := s.span(context.WithoutCancel(a.r.Context()), "gate.submit")
	var err error
	if a.plan != nil {
		rec.Result = a.plan
		rec, err = s.d.Tasks.Cached(ctx, rec)
	} else {
		rec, err = s.d.Tasks.Submit(ctx, rec)
	}
	end(err)
	if err != nil {
		s.writeErr(a.w, a.r, err)
		return
	}
	if a.plan != nil {
		s.m.cached.Inc()
	}
	s.admitted(a.w, a.st, rec, a.dec)
	writeJSON(a.w, http.StatusAccepted, createResponse{ID: rec.ID, Status: rec.Status, Quota: countsOf(a.st.principal, a.dec)})
}

// cachedPlan looks for a plan cached for the same normalised request and
// keeps it in a.plan; false when there is none (or the cache cannot be
// read: the request then goes on as without a cache).
func (s *server) cachedPlan(a *admission) bool {
	if a.req.Prompt != "" || s.d.PlanCache == nil {
		// Plans are cached for trips; a prompt's answer is never shared.
		return false
	}
	cr := plancache.Request{Destination: a.req.Destination, Days: a.req.Days, Interests: a.req.Interests, Language: a.req.Language}
	plan, ok, err := s.d.PlanCache.Get(a.r.Context(), cr)
	if err != nil || !ok {
		return false
	}
	var res task.Result
	if err := json.Unmarshal(plan.Result, &res); err != nil {
		return false
	}
	res.Cached = true
	a.plan = &res
	return true
}
