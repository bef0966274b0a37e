package agent

import (
	"context"
	"encoding/json"
	"faregate/agent/govern"
	"math"
	"strings"
	"testing"

	"faregate/agent/alert"
	"faregate/agent/chat"
	"faregate/agent/task"
	"faregate/protect/budget"
	"faregate/protect/codes"
)

// noFullHash fails when any alert shows more of the visitor's hash than
// its first 12 hex digits.
func noFullHash(t *testing.T, alerts []alert.Alert) {
	t.Helper()
	raw, err := json.Marshal(alerts)
	if err != nil {
		t.Fatal(err)
	}
	if hash := visitor[2:]; strings.Contains(string(raw), hash[:13]) {
		t.Fatalf("an alert shows more than 12 hex digits of the visitor's hash: %s", raw)
	}
}

// TestOverageAlert: a call that used more than its reservation raises
// overage for its task, with the figures behind it.
func TestOverageAlert(t *testing.T) {
	m := answers(chat.Usage{PromptTokens: 2000, CompletionTokens: 300, Reported: true})
	r := newRig(m)
	r.budget.Prices = map[string]int64{"primary": 3}
	rec, err := r.run(t, lisbon)
	if err != nil {
		t.Fatal(err)
	}
	reserved := r.budget.Settled()[0].Reservation.Tokens
	got := r.alerts.Of(alert.Overage)
	if len(got) != 1 {
		t.Fatalf("overage alerts %+v", r.alerts.All())
	}
	a := got[0]
	over := 2300 - reserved
	if a.Scope != "task:"+rec.ID || a.Severity != alert.Warning || !strings.Contains(a.Text, "primary") {
		t.Fatalf("alert %+v", a)
	}
	d := a.Details
	if d["model"] != "primary" || d["reserved_tokens"] != reserved || d["used_tokens"] != int64(2300) ||
		d["overage_tokens"] != over || d["overage_cost_micro"] != 3*over || d["late"] != false ||
		d["principal"] != "v:0123456789ab" || d["task"] != rec.ID {
		t.Fatalf("details %+v", d)
	}
	noFullHash(t, r.alerts.All())
}

// TestNoOverageNoAlert: a call within its reservation raises nothing.
func TestNoOverageNoAlert(t *testing.T) {
	r := newRig(answers(chat.Usage{PromptTokens: 200, CompletionTokens: 30, Reported: true}))
	if _, err := r.run(t, lisbon); err != nil {
		t.Fatal(err)
	}
	if all := r.alerts.All(); len(all) != 0 {
		t.Fatalf("alerts %+v", all)
	}
}

// TestLateOverageAlert: a settle that arrived after the reservation was
// given back is all overage, and the alert says it was late.
func TestLateOverageAlert(t *testing.T) {
	r := newRig(answers(chat.Usage{PromptTokens: 200, CompletionTokens: 30, Reported: true}))
	r.budget.SettleFn = func(_ context.Context, _ budget.Reservation, p, c int64) (budget.Settlement, error) {
		return budget.Settlement{Tokens: p + c, OverageTokens: p + c, Late: true}, nil
	}
	if _, err := r.run(t, lisbon); err != nil {
		t.Fatal(err)
	}
	got := r.alerts.Of(alert.Overage)
	if len(got) != 1 || got[0].Details["late"] != true || got[0].Details["overage_tokens"] != int64(230) {
		t.Fatalf("overage alerts %+v", got)
	}
}

// TestBudgetWarningAlerts: each daily scope a reservation or settlement
// took past 80% raises budget_warning, named without the visitor's hash.
func TestBudgetWarningAlerts(t *testing.T) {
	r := newRig(answers(chat.Usage{}))
	plain := r.budget.Reserve
	r.budget.ReserveFn = func(ctx context.Context, req budget.Request) (budget.Reservation, error) {
		r.budget.ReserveFn = nil
		res, err := plain(ctx, req)
		res.Warnings = []budget.ScopeEvent{
			{Scope: budget.ScopePrincipal, Name: visitor, Used: 32000, Limit: 40000},
			{Scope: budget.ScopeTier, Name: "public", Used: 120000, Limit: 150000},
			{Scope: budget.ScopeSite, Used: 160000, Limit: 200000},
		}
		return res, err
	}
	r.budget.SettleFn = func(_ context.Context, _ budget.Reservation, p, c int64) (budget.Settlement, error) {
		return budget.Settlement{Tokens: p + c, Warnings: []budget.ScopeEvent{{Scope: budget.ScopeSpend, Used: 8_000_000, Limit: 10_000_000}}}, nil
	}
	if _, err := r.run(t, lisbon); err != nil {
		t.Fatal(err)
	}
	got := r.alerts.Of(alert.BudgetWarning)
	var scopes []string
	for _, a := range got {
		scopes = append(scopes, a.Scope)
	}
	if strings.Join(scopes, ",") != "principal:v:0123456789ab,tier:public,site,spend" {
		t.Fatalf("warning scopes %v", scopes)
	}
	if d := got[0].Details; d["used"] != int64(32000) || d["limit"] != int64(40000) || d["unit"] != "tokens" {
		t.Fatalf("principal warning details %+v", d)
	}
	if d := got[3].Details; d["used"] != int64(8_000_000) || d["unit"] != "micro-units" {
		t.Fatalf("spend warning details %+v", d)
	}
	noFullHash(t, r.alerts.All())
}

// TestBudgetWarningSaysTheRealShare: the warning's text gives the share
// actually used. One overage run can take a scope from under 80% to far
// past its limit; the text said "80%" whatever the share ("has used 80%
// of its daily budget: 80000 of 40000 tokens").
func TestBudgetWarningSaysTheRealShare(t *testing.T) {
	r := newRig(answers(chat.Usage{}))
	r.budget.SettleFn = func(_ context.Context, _ budget.Reservation, p, c int64) (budget.Settlement, error) {
		return budget.Settlement{Tokens: p + c, Warnings: []budget.ScopeEvent{
			{Scope: budget.ScopePrincipal, Name: visitor, Used: 80000, Limit: 40000},
			{Scope: budget.ScopeSite, Used: 163999, Limit: 200000},
			{Scope: budget.ScopeSpend, Used: math.MaxInt64, Limit: 1},
		}}, nil
	}
	if _, err := r.run(t, lisbon); err != nil {
		t.Fatal(err)
	}
	got := r.alerts.Of(alert.BudgetWarning)
	if len(got) != 3 {
		t.Fatalf("%d warnings", len(got))
	}
	for i, want := range []string{"has used 200% of its daily budget: 80000 of 40000 tokens", "has used 81% of its daily budget: 163999 of 200000 tokens",
		"% of its daily budget: 9223372036854775807 of 1 micro-units"} {
		if !strings.Contains(got[i].Text, want) {
			t.Errorf("warning %d: %q, want %q", i, got[i].Text, want)
		}
	}
	if strings.Contains(got[2].Text, "used 80%") || strings.Contains(got[2].Text, "used -") {
		t.Errorf("the largest share: %q", got[2].Text)
	}
}

// TestBudgetExhaustedAlert: the first refusal of a scope today raises
// budget_exhausted for that scope; later refusals (First false) do not.
func TestBudgetExhaustedAlert(t *testing.T) {
	for _, tc := range []struct {
		scope budget.Scope
		want  string
	}{
		{budget.ScopePrincipal, "principal:v:0123456789ab"},
		{budget.ScopeTier, "tier:public"},
		{budget.ScopeSite, "site"},
		{budget.ScopeSpend, "spend"},
	} {
		t.Run(string(tc.scope), func(t *testing.T) {
			m := answers(chat.Usage{})
			r := newRig(m, newTool("guide_search"))
			first := true
			r.budget.ReserveFn = func(context.Context, budget.Request) (budget.Reservation, error) {
				ex := &budget.ExhaustedError{Scope: tc.scope, First: first}
				first = false
				return budget.Reservation{}, ex
			}
			_, err := r.run(t, lisbon)
			if code, _, _ := task.FailureOf(err); code != codes.AgentFailed || len(m.Turns()) != 0 {
				t.Fatalf("err %v after %d model calls", err, len(m.Turns()))
			}
			got := r.alerts.Of(alert.BudgetExhausted)
			if len(got) != 1 || got[0].Scope != tc.want || got[0].Severity != alert.Critical || got[0].Details["scope"] != string(tc.scope) {
				t.Fatalf("exhausted alerts %+v", got)
			}
			noFullHash(t, r.alerts.All())
		})
	}
}

// TestNoAlertCallback: without Deps.Alert a run raises nothing and works.
func TestNoAlertCallback(t *testing.T) {
	r := newRig(answers(chat.Usage{PromptTokens: 5000, CompletionTokens: 300, Reported: true}))
	d := r.deps()
	d.Alert = nil
	if err := NewWorkflow(r.cfg, d).Run(context.Background(), record(lisbon), func(*task.Record, ...task.Event) error { return nil }); err != nil {
		t.Fatal(err)
	}
}

// TestExhaustedAlertForms: the gate's alert and the run's come from one
// builder: the same scope forms and sentence, what is refused aside.
func TestExhaustedAlertForms(t *testing.T) {
	for _, tc := range []struct {
		scope budget.Scope
		want  string
	}{
		{budget.ScopePrincipal, "principal:v:0123456789ab"},
		{budget.ScopeTier, "tier:public"},
		{budget.ScopeTask, "task:t_1"},
		{budget.ScopeSite, "site"},
	} {
		ex := &budget.ExhaustedError{Scope: tc.scope, First: true, Remaining: 7}
		a := govern.ExhaustedAlert(ex, visitor, "public", "t_1", "new tasks")
		if a.Event != alert.BudgetExhausted || a.Scope != tc.want || a.Severity != alert.Critical ||
			a.Text != tc.want+" has exhausted its daily budget: new tasks are refused until midnight UTC" ||
			a.Details["remaining"] != int64(7) || a.Details["unit"] != "tokens" {
			t.Errorf("%s: %+v", tc.scope, a)
		}
	}
	if a := govern.ExhaustedAlert(&budget.ExhaustedError{Scope: budget.ScopePrincipal}, "k_acme", "", "", "model calls"); a.Scope != "principal:k:acme" {
		t.Errorf("key scope %q", a.Scope)
	}
}
