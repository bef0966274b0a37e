package main

import (
	"context"
	"errors"

	"faregate/agent/alert"
	"faregate/agent/govern"
	"faregate/api"
	"faregate/protect/budget"
	"faregate/protect/principal"
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
		a := govern.ExhaustedAlert(ex, r.Principal, r.Tier, "", "new tasks")
		a.Details["principal"] = principal.FromAccount(r.Principal).String()
		a.Details["at"] = "admission"
		b.notify(a)
	}
	return err
}
