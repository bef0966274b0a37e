package agent

import (
	"fmt"
	"math"

	"faregate/codes"
	"faregate/principal"
	"faregate/protect/alert"
	"faregate/protect/budget"
	"faregate/protect/ratelimit"
)

// scopeName names a budget scope for an alert: the principal in its shown
// form (an Account in, "principal:v:0123456789ab" out), a tier or a task
// by name, the site and the money cap by the scope alone.
func scopeName(s budget.Scope, name string) string {
	switch s {
	case budget.ScopePrincipal:
		return "principal:" + principal.FromAccount(name).String()
	case budget.ScopeTier, budget.ScopeTask:
		if name != "" {
			return string(s) + ":" + name
		}
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
	a.Details["principal"] = principal.FromAccount(r.rec.Principal).String()
	r.w.d.Alert(a)
}

// alertWarnings raises budget_warning for each daily scope a reservation
// or settlement took past 80% first today.
func (r *run) alertWarnings(events []budget.ScopeEvent) {
	for _, e := range events {
		scope := scopeName(e.Scope, e.Name)
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
	a := ExhaustedAlert(ex, req.Principal, req.Tier, req.Task, "model calls")
	a.Details["model"] = req.Model
	r.alert(a)
}

// ExhaustedAlert is the budget_exhausted alert of a scope's first refusal
// of the day, for a run's reservation and the gate's admission check alike
// (cmd/faregate raises the gate's): account, tier and taskID name the
// refused request (an Account, a tier name, a task id or ""), refused what
// the refusal stops ("model calls", "new tasks").
func ExhaustedAlert(ex *budget.ExhaustedError, account, tier, taskID, refused string) alert.Alert {
	name := ""
	switch ex.Scope {
	case budget.ScopePrincipal:
		name = account
	case budget.ScopeTier:
		name = tier
	case budget.ScopeTask:
		name = taskID
	}
	scope := scopeName(ex.Scope, name)
	return alert.Alert{Event: alert.BudgetExhausted, Scope: scope, Severity: alert.Critical,
		Text:    fmt.Sprintf("%s has exhausted its daily budget: %s are refused until midnight UTC", scope, refused),
		Details: map[string]any{"scope": string(ex.Scope), "remaining": ex.Remaining, "unit": unit(ex.Scope)}}
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
	who := principal.FromAccount(r.rec.Principal).String()
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
