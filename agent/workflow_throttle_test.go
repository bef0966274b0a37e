package agent

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"faregate/agent/alert"
	"faregate/agent/chat"
	"faregate/agent/govern"
	"faregate/agent/task"
	"faregate/protect/codes"
	"faregate/protect/kit/testkit/redistest"
	"faregate/protect/principal"
	"faregate/protect/ratelimit"
)

// hourly is a visitor's task record with an hourly quota of 10,000 tokens,
// throttled from 8,000.
func hourly() *task.Record {
	rec := record(lisbon)
	rec.Limits.TokensPerHour, rec.Limits.SoftTokens = 10_000, 8_000
	return rec
}

// softLimiter answers every call as taken from a principal past its soft
// share, in the hour's slot 42.
func softLimiter() *fakeLimiter {
	return &fakeLimiter{BeforeCallFn: func(context.Context, ratelimit.CallRequest) (ratelimit.CallDecision, error) {
		return ratelimit.CallDecision{Taken: true, Soft: true, HourUsed: 8_100, HourSlot: 42}, nil
	}}
}

// TestThrottledRunGoesToFallback: a run whose principal is past the soft
// share of its hourly tokens runs on the fallback model (the primary is
// never asked), carries the warnings throttled and downgraded (not
// fallback_model: it is not a failure), raises principal_throttled, and
// settles each call's take in the hour's slot it was added to.
func TestThrottledRunGoesToFallback(t *testing.T) {
	primary := &fakeModel{GenerateFn: func(context.Context, int, chat.Turn) (chat.Reply, error) {
		return chat.Reply{}, errors.New("the primary must not be asked")
	}}
	r := newRig(primary)
	r.models.Fallback = &govern.Model{Model: answers(chat.Usage{PromptTokens: 300, CompletionTokens: 50, Reported: true}), Name: "cheap"}
	r.limiter = softLimiter()
	rec := hourly()
	if err := r.workflow().Run(context.Background(), rec, func(*task.Record, ...task.Event) error { return nil }); err != nil {
		t.Fatal(err)
	}
	if len(primary.Turns()) != 0 || rec.Result.Model != "cheap" {
		t.Fatalf("primary asked %d times, result by %q", len(primary.Turns()), rec.Result.Model)
	}
	if !slices.Contains(rec.Warnings, codes.Throttled) || !slices.Contains(rec.Warnings, codes.Downgraded) ||
		slices.Contains(rec.Warnings, codes.FallbackModel) {
		t.Fatalf("warnings %v", rec.Warnings)
	}
	if a := r.alerts.Of(alert.PrincipalThrottled); len(a) == 0 || a[0].Scope != "principal:v:0123456789ab" || a[0].Window != time.Hour {
		t.Fatalf("principal_throttled alerts %+v", a)
	}
	for _, b := range r.limiter.Before() {
		if b.TokensPerHour != 10_000 || b.SoftTokens != 8_000 {
			t.Fatalf("the call asked the hour %d/%d; want 10000/8000", b.TokensPerHour, b.SoftTokens)
		}
	}
	var principal []ratelimit.SettleRequest
	for _, s := range r.limiter.settles {
		if s.Scope == principalScope(visitor) {
			principal = append(principal, s)
		}
	}
	if len(principal) == 0 {
		t.Fatal("no settle of the principal's take")
	}
	for _, s := range principal {
		if s.TokensPerHour != 10_000 || s.HourSlot != 42 || s.Actual != 350 {
			t.Fatalf("settle %+v; want the hour's slot 42 charged 350", s)
		}
	}
}

// TestThrottledWithoutFallback: without a fallback model a throttled run
// stays on the primary and says only that it was throttled.
func TestThrottledWithoutFallback(t *testing.T) {
	r := newRig(answers(chat.Usage{}))
	r.limiter = softLimiter()
	rec := hourly()
	if err := r.workflow().Run(context.Background(), rec, func(*task.Record, ...task.Event) error { return nil }); err != nil {
		t.Fatal(err)
	}
	if rec.Result.Model != "primary" || !slices.Contains(rec.Warnings, codes.Throttled) || slices.Contains(rec.Warnings, codes.Downgraded) {
		t.Fatalf("result by %q, warnings %v", rec.Result.Model, rec.Warnings)
	}
}

// TestHourShortRefusesCall: a call the hour cannot hold is refused as a
// budget refusal (a run with nothing yet fails as one whose day's budget
// ran out), naming the hour and its wait, and nothing stays reserved.
func TestHourShortRefusesCall(t *testing.T) {
	r := newRig(answers(chat.Usage{}))
	r.limiter = &fakeLimiter{BeforeCallFn: func(context.Context, ratelimit.CallRequest) (ratelimit.CallDecision, error) {
		return ratelimit.CallDecision{HourShort: true, RetryAfter: 30 * time.Minute, HourUsed: 9_900}, nil
	}}
	g := r.workflow().Governor()
	rec := hourly()
	spec := govern.Spec{TaskID: rec.ID, Principal: govern.PrincipalOf(rec), PromptTokens: 100}
	_, err := g.Call(context.Background(), spec, func(context.Context, govern.Attempt) (govern.Outcome, error) {
		t.Fatal("an attempt ran past a short hour")
		return govern.Outcome{}, nil
	})
	var re *ratelimit.RefusedError
	if !errors.Is(err, govern.ErrBudgetRefused) || !errors.Is(err, ratelimit.ErrHourExhausted) || !errors.As(err, &re) ||
		re.After != 30*time.Minute || re.Quota != 10_000 {
		t.Fatalf("err = %v", err)
	}
	if r.budget.Left != 1_000_000 {
		t.Fatalf("budget left %d: the reservation stayed", r.budget.Left)
	}
	rec = hourly()
	err = r.workflow().Run(context.Background(), rec, func(*task.Record, ...task.Event) error { return nil })
	if code, _, ok := task.FailureOf(err); !ok || code != codes.AgentFailed || !slices.Contains(rec.Warnings, codes.BudgetExhausted) {
		t.Fatalf("run: %v, warnings %v", err, rec.Warnings)
	}
}

// TestGovernedCallChargesHour: on a real rate limiter (miniredis and
// redis-server), a governed call holds its reservation in the hour while
// it runs and leaves what it was charged there when it settles.
func TestGovernedCallChargesHour(t *testing.T) {
	for _, be := range redistest.Both(t) {
		t.Run(be.Name, func(t *testing.T) {
			if err := be.Client.FlushDB(context.Background()).Err(); err != nil {
				t.Fatal(err)
			}
			g, spec, lim := governedRigOn(be.Client)
			spec.Principal.TokensPerHour, spec.Principal.SoftTokens = 100_000, 80_000
			scope := principal.FromAccount(spec.Principal.ID).Scope()
			var during int64
			out, err := g.Call(context.Background(), spec, func(ctx context.Context, a govern.Attempt) (govern.Outcome, error) {
				_, _, during, _ = lim.HourRoom(ctx, scope, spec.Principal.TokensPerHour, 0)
				return reported(ctx, a)
			})
			if err != nil {
				t.Fatal(err)
			}
			_, _, after, err := lim.HourRoom(context.Background(), scope, spec.Principal.TokensPerHour, 0)
			if err != nil {
				t.Fatal(err)
			}
			charged := out.Charged.Prompt + out.Charged.Completion
			if during <= charged || after != charged {
				t.Fatalf("hour during the call %d, after %d; want the reservation (> %d), then %d", during, after, charged, charged)
			}
		})
	}
}

// principalScope is the rate limiter's scope of a principal account.
func principalScope(account string) string { return principal.FromAccount(account).Scope() }
