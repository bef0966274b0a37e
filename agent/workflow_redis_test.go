package agent

import (
	"context"
	"errors"
	"testing"
	"time"

	"faregate/agent/alert"
	"faregate/agent/chat"
	"faregate/agent/govern"
	"faregate/agent/task"
	"faregate/protect/breaker"
	"faregate/protect/budget"
	"faregate/protect/codes"
	"faregate/protect/kit/testkit/redistest"
	"faregate/protect/principal"
	"faregate/protect/ratelimit"
)

// TestOnRealScripts runs the workflow on the real budget, ledger and rate
// limiter (on miniredis, at a fixed instant), so the fakes' reading of
// their contracts is checked against the scripts themselves.
func TestOnRealScripts(t *testing.T) {
	now := time.Date(2026, 8, 15, 12, 0, 0, 0, time.UTC)
	clock := func() time.Time { return now }

	t.Run("money, fallback and bucket", func(t *testing.T) {
		rdb := redistest.Mini(t).Client
		bud := budget.New(rdb, budget.Options{Now: clock,
			Limits: budget.Limits{Site: 1_000_000, Principal: 100_000, Task: 100_000, SpendMicro: 1_000_000_000},
			Prices: budget.Prices{"primary": {InputMicroPerMTok: 1_000_000, OutputMicroPerMTok: 2_000_000},
				"cheap": {InputMicroPerMTok: 100_000, OutputMicroPerMTok: 200_000}}})
		ledger := budget.NewLedger(rdb, clock)
		lim := ratelimit.New(rdb, ratelimit.Options{Now: clock})

		primary := answers(chat.Usage{})
		r := newRig(primary)
		r.models.Fallback = &govern.Model{Model: answers(chat.Usage{PromptTokens: 300, CompletionTokens: 50, Reported: true}), Name: "cheap"}
		r.models.Breaker = breaker.New(breaker.Settings{MinCalls: 1, MinPrincipals: 1, FailureRatio: 0.5, OpenFor: time.Hour}, nil, nil)
		_ = r.models.Breaker.Do(context.Background(), "v_test", func(context.Context, *breaker.Call) error { return errors.New("down") })
		d := r.deps()
		d.Budget, d.Ledger, d.Limiter = bud, ledger, lim
		rec := record(lisbon)
		if err := NewWorkflow(r.cfg, d).Run(context.Background(), rec, func(*task.Record, ...task.Event) error { return nil }); err != nil {
			t.Fatal(err)
		}
		if len(primary.Turns()) != 0 || rec.Result.Model != "cheap" {
			t.Fatalf("result %+v", rec.Result)
		}
		u, err := bud.Usage(context.Background(), budget.UsageQuery{Day: rec.Day, Principal: rec.Principal, Tier: rec.Tier, Task: rec.ID})
		if err != nil {
			t.Fatal(err)
		}
		// 300 input and 50 output tokens at the fallback's price: 30 + 10.
		if u.Principal.Settled != 350 || u.Principal.Outstanding != 0 || u.Spend.Settled != 40 || u.Spend.Outstanding != 0 ||
			u.Tier.Settled != 350 || u.Reservations != 0 {
			t.Fatalf("usage %+v: the primary's hold must be given back, the fallback's settled at its price", u)
		}
		totals, err := ledger.Totals(context.Background(), rec.Day, budget.ByModel)
		if err != nil {
			t.Fatal(err)
		}
		if len(totals) != 1 || totals[0].Key != "cheap" || totals[0].CostMicro != 40 || totals[0].Estimated != 0 {
			t.Fatalf("ledger totals %+v", totals)
		}
		// The bucket (capacity 2 × 6000) took prompt + max_tokens and got
		// back all but the 350 used; the clock stood still, so no refill.
		if lvl, err := lim.Level(context.Background(), principal.FromAccount(rec.Principal).Scope(), 6000); err != nil || lvl != 12000-350 {
			t.Fatalf("bucket level %v, %v", lvl, err)
		}
	})

	t.Run("input spike", func(t *testing.T) {
		rdb := redistest.Mini(t).Client
		lim := ratelimit.New(rdb, ratelimit.Options{Now: clock})
		m := searching()
		r := newRig(m, newTool("guide_search"))
		d := r.deps()
		d.Limiter = lim
		n := 0
		d.Estimate = func(string, []chat.Message, []chat.ToolDef) int64 {
			n++
			if n == 6 {
				return 12000
			}
			return 1000
		}
		err := NewWorkflow(r.cfg, d).Run(context.Background(), record(lisbon), func(*task.Record, ...task.Event) error { return nil })
		if code, _, _ := task.FailureOf(err); code != codes.InputSpike || len(m.Turns()) != 5 {
			t.Fatalf("err %v after %d model calls", err, len(m.Turns()))
		}
		a := r.alerts.Of(alert.Anomaly)
		if len(a) != 1 || a[0].Details["ema"] != 1000.0 || a[0].Details["anomalies_in_hour"] != int64(1) || a[0].Details["samples"] != int64(5) {
			t.Fatalf("anomaly alerts %+v", a)
		}
	})
}
