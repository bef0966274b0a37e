package main

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"faregate/api"
	"faregate/protect/alert"
	"faregate/protect/budget"
)

// admissionBudget is the budget as the gate sees it, raising
// budget_exhausted when an admission check is a scope's first refusal of
// the day. The budget decides "first" once across replicas, for a run's
// reservation and for the gate's check alike; the runs alert on theirs, so
// without this a day whose first refusal came at the gate (the usual case:
// the gate refuses a task that could not pay for its first call) would
// never be alerted.
//
// It also prices the minimal run at the request (runCost), not once at
// start: a policy reload may change the prices, and the next admission
// must be checked at the new ones.
type admissionBudget struct {
	*budget.Budget
	notify  func(alert.Alert)
	runCost func() int64
}

var _ api.Budget = admissionBudget{}

// CanAfford asks the budget and alerts on a first refusal.
func (b admissionBudget) CanAfford(ctx context.Context, r budget.AffordRequest) error {
	if b.runCost != nil {
		r.CostMicro = b.runCost()
	}
	err := b.Budget.CanAfford(ctx, r)
	var ex *budget.ExhaustedError
	if errors.As(err, &ex) && ex.First {
		scope := string(ex.Scope)
		switch ex.Scope {
		case budget.ScopePrincipal:
			scope = "principal:" + shownAccount(r.Principal)
		case budget.ScopeTier:
			scope = "tier:" + r.Tier
		}
		unit := "tokens"
		if ex.Scope == budget.ScopeSpend {
			unit = "micro-units"
		}
		b.notify(alert.Alert{Event: alert.BudgetExhausted, Scope: scope, Severity: alert.Critical,
			Text: fmt.Sprintf("%s has exhausted its daily budget: new tasks are refused until midnight UTC", scope),
			Details: map[string]any{"scope": string(ex.Scope), "remaining": ex.Remaining, "unit": unit,
				"principal": shownAccount(r.Principal), "at": "admission"}})
	}
	return err
}

// shownAccount is a budget account as alerts show it (the agent's form): a
// key's id whole ("k:acme"), a visitor's hash cut to 12 hex digits.
func shownAccount(p string) string {
	if id, ok := strings.CutPrefix(p, "k_"); ok {
		return "k:" + id
	}
	return "v:" + clip(strings.TrimPrefix(p, "v_"), 12)
}
