package agent

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"faregate/agent/chat"
	"faregate/agent/govern"
	"faregate/agent/task"
	"faregate/protect/breaker"
	"faregate/protect/budget"
	"faregate/protect/codes"
)

// answers is a model that answers every call with a plan and the usage given.
func answers(usage chat.Usage) *fakeModel {
	return &fakeModel{GenerateFn: func(context.Context, int, chat.Turn) (chat.Reply, error) {
		rep := plan(2)
		rep.Usage = usage
		return rep, nil
	}}
}

// TestReservationNamesScopes: a reservation carries the task's principal,
// its tier's limits as the task was admitted, and the model it is for; a
// tier without a share of the site's tokens is not charged as a tier.
func TestReservationNamesScopes(t *testing.T) {
	for _, tc := range []struct {
		name       string
		limits     task.Limits
		tier       string
		tierLimit  int64
		principal  string
		principalL int64
	}{
		{"visitor with a tier share", task.Limits{TokensPerDay: 40000, TierTokens: 150000}, "public", 150000, visitor, 40000},
		{"key without a tier share", task.Limits{TokensPerDay: 2000000}, "", 0, "k_acme", 2000000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(answers(chat.Usage{}))
			rec := record(lisbon)
			rec.Principal, rec.Tier, rec.Limits = tc.principal, "partner", tc.limits
			if tc.tier != "" {
				rec.Tier = tc.tier
			}
			if err := r.workflow().Run(context.Background(), rec, func(*task.Record, ...task.Event) error { return nil }); err != nil {
				t.Fatal(err)
			}
			got := r.budget.Reserved()[0]
			if got.Principal != tc.principal || got.PrincipalLimit != tc.principalL || got.Tier != tc.tier ||
				got.TierLimit != tc.tierLimit || got.Model != "primary" || got.Task != rec.ID || got.Day != rec.Day {
				t.Fatalf("reservation %+v", got)
			}
		})
	}
}

// TestMoneyFollowsTheModel: the reservation is priced for the model that
// serves the call. After an open breaker the call goes to the fallback: the
// primary's reservation is given back untouched (0/0) and the fallback's,
// at its own price, is settled with the usage reported, prompt and
// completion apart.
func TestMoneyFollowsTheModel(t *testing.T) {
	primary := &fakeModel{GenerateFn: func(context.Context, int, chat.Turn) (chat.Reply, error) {
		return chat.Reply{}, errors.New("503 from provider")
	}}
	cheap := answers(chat.Usage{PromptTokens: 300, CompletionTokens: 50, Reported: true})
	r := newRig(primary)
	r.models.Fallback = &govern.Model{Model: cheap, Name: "cheap"}
	r.models.Breaker = breaker.New(breaker.Settings{MinCalls: 1, MinPrincipals: 1, FailureRatio: 0.5, OpenFor: time.Hour}, nil, nil)
	_ = r.models.Breaker.Do(context.Background(), "v_test", func(context.Context, *breaker.Call) error { return errors.New("down") })
	if r.models.Breaker.State() != breaker.Open {
		t.Fatal("the breaker did not open")
	}
	r.budget.Prices = map[string]int64{"primary": 10, "cheap": 1}

	rec, err := r.run(t, lisbon)
	if err != nil {
		t.Fatal(err)
	}
	if len(primary.Turns()) != 0 || rec.Result.Model != "cheap" || !slices.Contains(rec.Warnings, codes.FallbackModel) {
		t.Fatalf("primary called %d times; result %+v warnings %v", len(primary.Turns()), rec.Result, rec.Warnings)
	}
	res := r.budget.Reserved()
	if len(res) != 2 || res[0].Model != "primary" || res[1].Model != "cheap" {
		t.Fatalf("reservations %+v: want the primary's, then the fallback's", res)
	}
	st := r.budget.Settled()
	if len(st) != 2 {
		t.Fatalf("settlements %+v", st)
	}
	if back := st[0]; back.Reservation.Model != "primary" || back.Prompt != 0 || back.Completion != 0 ||
		back.Reservation.CostMicro != back.Reservation.Tokens*10 {
		t.Fatalf("the primary's reservation was not given back whole: %+v", back)
	}
	if used := st[1]; used.Reservation.Model != "cheap" || used.Prompt != 300 || used.Completion != 50 ||
		used.Reservation.CostMicro != used.Reservation.Tokens*1 {
		t.Fatalf("the fallback's settlement %+v", used)
	}
	if e := r.ledger.Entries(); len(e) != 1 || e[0].Model != "cheap" || e[0].CostMicro != 350 {
		t.Fatalf("ledger %+v: want only the call that reached a model", e)
	}
	if r.budget.Left != 1_000_000-350 {
		t.Fatalf("budget left %d: something was not given back", r.budget.Left)
	}
}

// TestBreakerOpenWithoutFallbackGivesBack: a call the breaker refuses with
// no fallback gives its reservation back and leaves no ledger entry.
func TestBreakerOpenWithoutFallbackGivesBack(t *testing.T) {
	m := answers(chat.Usage{})
	r := newRig(m)
	r.models.Breaker = breaker.New(breaker.Settings{MinCalls: 1, MinPrincipals: 1, FailureRatio: 0.5, OpenFor: time.Hour}, nil, nil)
	_ = r.models.Breaker.Do(context.Background(), "v_test", func(context.Context, *breaker.Call) error { return errors.New("down") })
	_, err := r.run(t, lisbon)
	if code, _, ok := task.FailureOf(err); !ok || code != codes.ModelUnavailable {
		t.Fatalf("err %v", err)
	}
	st := r.budget.Settled()
	if len(m.Turns()) != 0 || len(st) != 1 || st[0].Actual() != 0 || len(r.ledger.Entries()) != 0 || r.budget.Left != 1_000_000 {
		t.Fatalf("%d model calls, settlements %+v, ledger %+v, left %d", len(m.Turns()), st, r.ledger.Entries(), r.budget.Left)
	}
}

// TestLedgerEntries: an entry names the principal and request, carries
// the settlement's cost and overage, and says whether the tokens were
// the provider's count or faregate's estimate.
func TestLedgerEntries(t *testing.T) {
	m := &fakeModel{GenerateFn: func(_ context.Context, n int, turn chat.Turn) (chat.Reply, error) {
		if n == 1 {
			rep := calls("guide_search", `{"query":"Lisbon"}`)
			rep.Usage = chat.Usage{PromptTokens: 400, CompletionTokens: 30, Reported: true}
			return rep, nil
		}
		return plan(2), nil // no usage reported
	}}
	r := newRig(m, newTool("guide_search"))
	r.budget.Prices = map[string]int64{"primary": 2}
	r.budget.SettleFn = func(_ context.Context, res budget.Reservation, p, c int64) (budget.Settlement, error) {
		return budget.Settlement{Tokens: p + c, CostMicro: 2 * (p + c), OverageTokens: 7, OverageCostMicro: 14}, nil
	}
	rec, err := r.run(t, lisbon)
	if err != nil {
		t.Fatal(err)
	}
	e := r.ledger.Entries()
	if len(e) != 2 {
		t.Fatalf("ledger %+v", e)
	}
	for _, x := range e {
		if x.Principal != visitor || x.RequestID != "req-1" || x.Task != rec.ID || x.OverageTokens != 7 || x.OverageCostMicro != 14 ||
			x.CostMicro != 2*(x.PromptTokens+x.CompletionTokens) || x.Reserved == 0 || x.Outcome != budget.OutcomeOK {
			t.Fatalf("entry %+v", x)
		}
	}
	if e[0].Estimated || e[0].PromptTokens != 400 || !e[1].Estimated {
		t.Fatalf("estimated flags: %+v", e)
	}
}

// TestNoLedgerEntryForRefusals: a call the budget refused never reached
// a model: no entry, no tokens.
func TestNoLedgerEntryForRefusals(t *testing.T) {
	m := answers(chat.Usage{})
	r := newRig(m)
	r.budget.Left = 10
	rec, err := r.run(t, lisbon)
	if code, _, ok := task.FailureOf(err); !ok || code != codes.AgentFailed {
		t.Fatalf("err %v", err)
	}
	if len(m.Turns()) != 0 || len(r.ledger.Entries()) != 0 || rec.Usage != (task.Usage{}) {
		t.Fatalf("%d model calls, ledger %+v, usage %+v", len(m.Turns()), r.ledger.Entries(), rec.Usage)
	}
}

// TestClosingCallFitsTokenScopesOnly: the closing call shrinks to what a
// token scope has left, but never reads a spend refusal's micro-units as
// tokens.
func TestClosingCallFitsTokenScopesOnly(t *testing.T) {
	for _, tc := range []struct {
		scope budget.Scope
		ok    bool
	}{
		{budget.ScopePrincipal, true},
		{budget.ScopeTier, true},
		{budget.ScopeSite, true},
		{budget.ScopeTask, true},
		{budget.ScopeSpend, false},
	} {
		t.Run(string(tc.scope), func(t *testing.T) {
			m := answers(chat.Usage{})
			r := newRig(m, newTool("guide_search"))
			r.cfg.MaxToolCalls = 0 // the one call has no tools: it may shrink
			r.budget.ReserveFn = func(_ context.Context, req budget.Request) (budget.Reservation, error) {
				if req.MaxTokens == 1024 {
					return budget.Reservation{}, &budget.ExhaustedError{Scope: tc.scope, Remaining: req.PromptTokens + 500}
				}
				return budget.Reservation{ID: "r", Model: req.Model, Tokens: req.PromptTokens + req.MaxTokens}, nil
			}
			_, err := r.run(t, lisbon)
			var shrunk []int64
			for _, req := range r.budget.Reserved() {
				if req.MaxTokens != 1024 {
					shrunk = append(shrunk, req.MaxTokens)
				}
			}
			if (err == nil) != tc.ok {
				t.Fatalf("err %v", err)
			}
			if !tc.ok {
				if len(shrunk) != 0 || len(m.Turns()) != 0 {
					t.Fatalf("a spend refusal was read as tokens: reserved max_tokens %v, %d model calls", shrunk, len(m.Turns()))
				}
				return
			}
			if !slices.Equal(shrunk, []int64{500}) || m.Turns()[0].MaxTokens != 500 {
				t.Fatalf("shrunk reservations %v, max_tokens %d; want the 500 left", shrunk, m.Turns()[0].MaxTokens)
			}
		})
	}
}

// TestFailureCode reads a run error's code; other errors are not failures.
func TestFailureCode(t *testing.T) {
	err := fmtWrap(task.Fail(codes.InputSpike, "spike"))
	if code, msg, ok := task.FailureOf(err); !ok || code != codes.InputSpike || msg != "spike" {
		t.Fatalf("FailureCode = %q, %q, %v", code, msg, ok)
	}
	if _, _, ok := task.FailureOf(context.DeadlineExceeded); ok {
		t.Fatal("a context's end read as a failure")
	}
}

func fmtWrap(err error) error { return errors.Join(errors.New("run"), err) }

// TestModelsNext is the model Do tries first.
func TestModelsNext(t *testing.T) {
	ms := &govern.Models{Primary: govern.Model{Name: "primary"}}
	if ms.Next(true).Name != "primary" {
		t.Fatal("low precision without a fallback must use the primary")
	}
	ms.Fallback = &govern.Model{Name: "cheap"}
	ms.Breaker = breaker.New(breaker.Settings{MinCalls: 1, MinPrincipals: 1, FailureRatio: 0.5, OpenFor: time.Hour}, nil, nil)
	_ = ms.Breaker.Do(context.Background(), "v_test", func(context.Context, *breaker.Call) error { return errors.New("down") })
	if ms.Next(false).Name != "primary" || ms.Next(true).Name != "cheap" {
		t.Fatalf("Next: %q, %q", ms.Next(false).Name, ms.Next(true).Name)
	}
}

// TestEstimateIsPerModel: the injected estimate is asked for the model the
// call is reserved for, and MinRunTokens uses it too.
func TestEstimateIsPerModel(t *testing.T) {
	r := newRig(answers(chat.Usage{}))
	var asked []string
	d := r.deps()
	d.Estimate = func(model string, _ []chat.Message, _ []chat.ToolDef) int64 {
		asked = append(asked, model)
		return 777
	}
	w := NewWorkflow(r.cfg, d)
	if got := w.MinRunTokens(); got != 777+1024 {
		t.Fatalf("MinRunTokens %d", got)
	}
	if err := w.Run(context.Background(), record(lisbon), func(*task.Record, ...task.Event) error { return nil }); err != nil {
		t.Fatal(err)
	}
	if got := r.budget.Reserved()[0]; got.PromptTokens != 777 || !slices.Equal(asked, []string{"primary", "primary"}) {
		t.Fatalf("reservation %+v, estimates asked for %v", got, asked)
	}
}
