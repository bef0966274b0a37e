package govern

import (
	"fmt"
	"math"

	"faregate/agent/alert"
	"faregate/protect/budget"
	"faregate/protect/codes"
	"faregate/protect/principal"
	"faregate/protect/ratelimit"
)

// principalScope is the rate limiter's scope of a principal account
// ("v_<hash>" → "v:<hash>"): principal.Principal's Scope form.
func principalScope(account string) string { return principal.FromAccount(account).Scope() }

// shownPrincipal is a principal as alerts show it (principal.Principal's
// String form: a visitor's hash cut, a key's id whole).
func shownPrincipal(account string) string { return principal.FromAccount(account).String() }

// scopeName names a budget scope of this run for an alert.
func scopeName(s budget.Scope, name string) string {
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

// callAlerts raises the alerts of one governed call's task and principal.
type callAlerts struct {
	notify          func(alert.Alert) // nil: none
	task, principal string
}

// alert hands a to the caller's Alert, if any.
func (r callAlerts) alert(a alert.Alert) {
	if r.notify == nil {
		return
	}
	if a.Details == nil {
		a.Details = map[string]any{}
	}
	a.Details["task"] = r.task
	a.Details["principal"] = shownPrincipal(r.principal)
	r.notify(a)
}

// alertWarnings raises budget_warning for each daily scope a reservation
// or settlement took past 80% first today.
func (r callAlerts) alertWarnings(events []budget.ScopeEvent) {
	for _, e := range events {
		scope := scopeName(e.Scope, e.Name)
		r.alert(alert.Alert{Event: alert.BudgetWarning, Scope: scope, Severity: alert.Warning,
			Text:    fmt.Sprintf("%s has used %s of its daily budget: %d of %d %s", scope, share(e.Used, e.Limit), e.Used, e.Limit, unit(e.Scope)),
			Details: map[string]any{"scope": string(e.Scope), "used": e.Used, "limit": e.Limit, "unit": unit(e.Scope)}})
	}
}

// share is used as a whole percentage of limit, rounded down: the real
// share, which one overage can take far past the 80% that raised the
// warning. Computed in floating point, so no provider number overflows it.
func share(used, limit int64) string {
	if limit <= 0 {
		return "all"
	}
	return fmt.Sprintf("%.0f%%", math.Floor(float64(used)/float64(limit)*100))
}

// alertExhausted raises budget_exhausted on a scope's first refusal of the
// day (the budget decides which is first, once across replicas).
func (r callAlerts) alertExhausted(ex *budget.ExhaustedError, req budget.Request) {
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
// refused request (an account, a tier name, a task id or ""), refused what
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
func (r callAlerts) alertOverage(res budget.Reservation, s budget.Settlement) {
	if s.OverageTokens <= 0 && s.OverageCostMicro <= 0 {
		return
	}
	late := ""
	if s.Late {
		late = " (settled after its reservation had been given back)"
	}
	r.alert(alert.Alert{Event: alert.Overage, Scope: "task:" + r.task, Severity: alert.Warning,
		Text: fmt.Sprintf("task %s used %d tokens on %s, %d over its reservation of %d%s",
			r.task, s.Tokens, res.Model, s.OverageTokens, res.Tokens, late),
		Details: map[string]any{"model": res.Model, "reserved_tokens": res.Tokens, "reserved_cost_micro": res.CostMicro,
			"used_tokens": s.Tokens, "used_cost_micro": s.CostMicro,
			"overage_tokens": s.OverageTokens, "overage_cost_micro": s.OverageCostMicro, "late": s.Late}})
}

// alertSpike raises anomaly for an input spike: a call whose prompt was
// over 10× the principal's average, which was not made.
func (r callAlerts) alertSpike(prompt int64, d ratelimit.CallDecision) {
	who := shownPrincipal(r.principal)
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

// alertImplausible raises usage_implausible for a provider's report the
// budget would not charge as it stood. It is the provider's doing, not the
// visitor's: scoped to the model, never counted as the visitor's anomaly.
func (r callAlerts) alertImplausible(model string, res budget.Reservation, call budget.Call, charged int64) {
	r.alert(alert.Alert{Event: alert.UsageImplausible, Scope: "model:" + model, Severity: alert.Warning,
		Text: fmt.Sprintf("%s reported a usage faregate cannot charge as it stands; the call was charged %d tokens (reserved %d, counted %d)",
			model, charged, res.Tokens, call.Counted),
		Details: map[string]any{"model": model, "raw_usage": call.Raw, "reserved_tokens": res.Tokens,
			"counted_tokens": call.Counted, "charged_tokens": charged}})
}

// alertThrottled raises principal_throttled: a call found its principal
// past the soft share of its hourly tokens (used of them, charged and
// held). Once per principal and hour; the gate raises the same alert on
// the same scope, so either is the one sent.
func (r callAlerts) alertThrottled(used int64, p Principal) {
	who := shownPrincipal(r.principal)
	r.alert(alert.Alert{Event: alert.PrincipalThrottled, Scope: "principal:" + who, Severity: alert.Warning, Window: ratelimit.HourWindow,
		Text: fmt.Sprintf("%s has used %d of its %d tokens an hour (held back from %d): its model calls go to the fallback model first",
			who, used, p.TokensPerHour, p.SoftTokens),
		Details: map[string]any{"used": used, "limit": p.TokensPerHour, "soft": p.SoftTokens}})
}
