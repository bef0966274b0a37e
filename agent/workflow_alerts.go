package agent

import (
	"fmt"
	"math"
	"strings"

	"faregate/codes"
	"faregate/protect/alert"
	"faregate/protect/budget"
	"faregate/protect/ratelimit"
)

// shownHash is how much of a visitor's hash an alert may show: enough to
// tell visitors apart in a day's alerts, too little to be the key itself.
const shownHash = 12

// principalScope is the rate limiter's scope of a principal, the api's
// Principal.Scope form: "v_<hash>" → "v:<hash>", "k_<id>" → "k:<id>".
func principalScope(p string) string {
	if len(p) > 2 && (p[:2] == "v_" || p[:2] == "k_") {
		return p[:1] + ":" + p[2:]
	}
	return p
}

// shownPrincipal is a principal as alerts show it: a visitor's hash cut to
// its first 12 hex digits ("v:0123456789ab"), a key's id whole ("k:acme").
// Anything else is cut like a hash, in case it is one.
func shownPrincipal(p string) string {
	switch {
	case strings.HasPrefix(p, "k_"):
		return principalScope(p)
	case strings.HasPrefix(p, "v_"):
		return "v:" + clipBytes(p[2:], shownHash)
	}
	return clipBytes(p, shownHash)
}

func clipBytes(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

// scopeName names a budget scope of this run for an alert.
func (r *run) scopeName(s budget.Scope, name string) string {
	switch s {
	case budget.ScopePrincipal:
		return "principal:" + shownPrincipal(name)
	case budget.ScopeTier, budget.ScopeTask:
		return string(s) + ":" + name
	}
	return string(s)
}

// unit is what a budget scope counts.
func unit(s budget.Scope) string {
	if s == budget.ScopeSpend {
		return "micro-units"
	}
	return "tokens"
}

// alert hands a to the caller's Alert, if any.
func (r *run) alert(a alert.Alert) {
	if r.w.d.Alert == nil {
		return
	}
	if a.Details == nil {
		a.Details = map[string]any{}
	}
	a.Details["task"] = r.rec.ID
	a.Details["principal"] = shownPrincipal(r.rec.Principal)
	r.w.d.Alert(a)
}

// alertWarnings raises budget_warning for each daily scope a reservation
// or settlement took past 80% first today.
func (r *run) alertWarnings(events []budget.ScopeEvent) {
	for _, e := range events {
		scope := r.scopeName(e.Scope, e.Name)
		r.alert(alert.Alert{Event: alert.BudgetWarning, Scope: scope, Severity: alert.Warning,
			Text:    fmt.Sprintf("%s has used 80%% of its daily budget: %d of %d %s", scope, e.Used, e.Limit, unit(e.Scope)),
			Details: map[string]any{"scope": string(e.Scope), "used": e.Used, "limit": e.Limit, "unit": unit(e.Scope)}})
	}
}

// alertExhausted raises budget_exhausted on a scope's first refusal of the
// day (the budget decides which is first, once across replicas).
func (r *run) alertExhausted(ex *budget.ExhaustedError, req budget.Request) {
	if !ex.First {
		return
	}
	name := ""
	switch ex.Scope {
	case budget.ScopePrincipal:
		name = req.Principal
	case budget.ScopeTier:
		name = req.Tier
	case budget.ScopeTask:
		name = req.Task
	}
	scope := r.scopeName(ex.Scope, name)
	r.alert(alert.Alert{Event: alert.BudgetExhausted, Scope: scope, Severity: alert.Critical,
		Text: fmt.Sprintf("%s has exhausted its daily budget: model calls are refused until midnight UTC", scope),
		Details: map[string]any{"scope": string(ex.Scope), "remaining": ex.Remaining, "unit": unit(ex.Scope),
			"model": req.Model}})
}

// alertOverage raises overage when a settlement charged beyond its hold.
func (r *run) alertOverage(res budget.Reservation, s budget.Settlement) {
	if s.OverageTokens <= 0 && s.OverageCostMicro <= 0 {
		return
	}
	late := ""
	if s.Late {
		late = " (settled after its reservation had been given back)"
	}
	r.alert(alert.Alert{Event: alert.Overage, Scope: "task:" + r.rec.ID, Severity: alert.Warning,
		Text: fmt.Sprintf("task %s used %d tokens on %s, %d over its reservation of %d%s",
			r.rec.ID, s.Tokens, res.Model, s.OverageTokens, res.Tokens, late),
		Details: map[string]any{"model": res.Model, "reserved_tokens": res.Tokens, "reserved_cost_micro": res.CostMicro,
			"used_tokens": s.Tokens, "used_cost_micro": s.CostMicro,
			"overage_tokens": s.OverageTokens, "overage_cost_micro": s.OverageCostMicro, "late": s.Late}})
}

// alertSpike raises anomaly for an input spike: a call whose prompt was
// over 10× the principal's average, which was not made.
func (r *run) alertSpike(prompt int64, d ratelimit.CallDecision) {
	who := shownPrincipal(r.rec.Principal)
	details := map[string]any{"kind": codes.InputSpike, "prompt_tokens": prompt, "ema": d.EMA, "samples": d.Samples,
		"anomalies_in_hour": d.AnomaliesInHour}
	if d.BlockedFor > 0 {
		details["blocked_for_seconds"] = int64(math.Ceil(d.BlockedFor.Seconds()))
	}
	r.alert(alert.Alert{Event: alert.Anomaly, Scope: "principal:" + who, Severity: alert.Warning,
		Text: fmt.Sprintf("input spike from %s: a prompt of %d tokens against an average of %.0f; the call was not made (%d in the last hour)",
			who, prompt, d.EMA, d.AnomaliesInHour),
		Details: details})
}
