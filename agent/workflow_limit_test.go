package agent

import (
	"context"
	"errors"
	"faregate/agent/govern"
	"fmt"
	"slices"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"faregate/agent/alert"
	"faregate/agent/chat"
	"faregate/agent/task"
	"faregate/protect/codes"
	"faregate/protect/ratelimit"
)

var _ govern.Limiter = (*ratelimit.Limiter)(nil)

// searching is a model that asks for a new guide search at every step
// while tools are offered, and answers when they are not.
func searching() *fakeModel {
	return &fakeModel{GenerateFn: func(_ context.Context, n int, turn chat.Turn) (chat.Reply, error) {
		if len(turn.Tools) == 0 {
			return plan(2), nil
		}
		return calls("guide_search", fmt.Sprintf(`{"query":"page %d"}`, n)), nil
	}}
}

// TestInputSpike: five calls of a normal size, then one at 12× the
// principal's average: that call is not made, the task ends input_spike,
// and an anomaly alert fires.
func TestInputSpike(t *testing.T) {
	m := searching()
	r := newRig(m, newTool("guide_search"))
	r.limiter = &fakeLimiter{BeforeCallFn: emaSpikes()}
	d := r.deps()
	estimates := 0
	d.Estimate = func(string, []chat.Message, []chat.ToolDef) int64 {
		estimates++
		if estimates == 6 {
			return 12000
		}
		return 1000
	}
	rec := record(lisbon)
	var events []task.Event
	err := NewWorkflow(r.cfg, d).Run(context.Background(), rec, func(_ *task.Record, evs ...task.Event) error {
		events = append(events, evs...)
		return nil
	})
	code, msg, ok := task.FailureOf(err)
	if !ok || code != codes.InputSpike || !strings.Contains(msg, "not made") {
		t.Fatalf("err %v", err)
	}
	if n := len(m.Turns()); n != 5 {
		t.Fatalf("%d model calls, want the 5 before the spike", n)
	}
	// The spiking call's reserve went to Redis beside the spike check
	// (one round trip) and was withdrawn: nothing of it remains, and no
	// budget alert was raised for it.
	if n, w := len(r.budget.Reserved()), r.budget.Withdrawn(); n != 6 || len(w) != 1 || w[0].ID != r.budget.Reserved()[5].ID || r.budget.Open() != 0 {
		t.Fatalf("%d reserves, %d withdrawn, %d open: the spike must be refused before the budget", n, len(w), r.budget.Open())
	}
	if n := len(r.ledger.Entries()); n != 5 {
		t.Fatalf("%d ledger entries", n)
	}
	if after := r.limiter.After(); len(after) != 5 {
		t.Fatalf("AfterCall %d times: the refused call took nothing", len(after))
	}
	got := r.alerts.Of(alert.Anomaly)
	if len(got) != 1 {
		t.Fatalf("anomaly alerts %+v", r.alerts.All())
	}
	a := got[0]
	if a.Scope != "principal:v:0123456789ab" || a.Details["prompt_tokens"] != int64(12000) || a.Details["ema"] != 1000.0 ||
		a.Details["anomalies_in_hour"] != int64(1) || a.Details["task"] != rec.ID {
		t.Fatalf("anomaly alert %+v", a)
	}
	noFullHash(t, r.alerts.All())
	r.events = events
	steps := r.steps(t)
	if s := steps[len(steps)-1]; s.Kind != "model" || s.Status != "failed" || s.Detail != msg {
		t.Fatalf("the refused call's step %+v", s)
	}
}

// TestBeforeCallRequest: the limiter is asked with the principal's scope
// in the api's form, the prompt estimate, prompt + max_tokens and the
// principal's rate; a rate of 0 still asks (the spike check runs).
func TestBeforeCallRequest(t *testing.T) {
	for _, tpm := range []int64{6000, 0} {
		t.Run(fmt.Sprint(tpm), func(t *testing.T) {
			m := answers(chat.Usage{})
			r := newRig(m)
			r.limiter = &fakeLimiter{}
			rec := record(lisbon)
			rec.Limits.TokensPerMinute = tpm
			if err := r.workflow().Run(context.Background(), rec, func(*task.Record, ...task.Event) error { return nil }); err != nil {
				t.Fatal(err)
			}
			prompt := chat.EstimatePrompt(m.Turns()[0].Messages, nil)
			b := r.limiter.Before()
			if len(b) != 1 || b[0].Scope != "v:"+visitor[2:] || b[0].PromptTokens != prompt || b[0].Amount != prompt+1024 ||
				b[0].TokensPerMinute != tpm || b[0].Op == "" {
				t.Fatalf("BeforeCall %+v", b)
			}
			if a := r.limiter.After(); len(a) != 1 || a[0].Op != b[0].Op || a[0].TPM != tpm || a[0].Scope != b[0].Scope {
				t.Fatalf("AfterCall %+v", a)
			}
		})
	}
}

// shortThen is a BeforeCallFn whose bucket is short for each wait given,
// then takes.
func shortThen(waits ...time.Duration) func(context.Context, ratelimit.CallRequest) (ratelimit.CallDecision, error) {
	n := 0
	return func(context.Context, ratelimit.CallRequest) (ratelimit.CallDecision, error) {
		if n < len(waits) {
			n++
			return ratelimit.CallDecision{RetryAfter: waits[n-1]}, nil
		}
		return ratelimit.CallDecision{Taken: true}, nil
	}
}

// TestBucketWaits: a short bucket is waited for, exactly as long as the
// limiter says each time, asking again with a new op; then the call is made
// and its step says it waited.
func TestBucketWaits(t *testing.T) {
	m := answers(chat.Usage{PromptTokens: 300, CompletionTokens: 40, Reported: true})
	r := newRig(m)
	r.limiter = &fakeLimiter{BeforeCallFn: shortThen(3*time.Second, 5*time.Second)}
	r.sleeps = &sleepLog{}
	if _, err := r.run(t, lisbon); err != nil {
		t.Fatal(err)
	}
	if w := r.sleeps.Waits(); !slices.Equal(w, []time.Duration{3 * time.Second, 5 * time.Second}) {
		t.Fatalf("waits %v", w)
	}
	b := r.limiter.Before()
	if len(b) != 3 || b[0].Op == b[1].Op || b[1].Op == b[2].Op || b[0].Op == b[2].Op {
		t.Fatalf("BeforeCall %+v: want three asks with new ops", b)
	}
	if len(m.Turns()) != 1 {
		t.Fatalf("%d model calls", len(m.Turns()))
	}
	if a := r.limiter.After(); len(a) != 1 || a[0].Op != b[2].Op || a[0].Reserved != b[2].Amount || a[0].Actual != 340 {
		t.Fatalf("AfterCall %+v: want the taken op settled with 340", a)
	}
	steps := r.steps(t)
	if s := steps[len(steps)-1]; s.Status != "ok" || s.Detail != "primary (waited 8s for tokens)" {
		t.Fatalf("step %+v", s)
	}
}

// TestBucketWaitBound: a wait that would take the call past TokenWait ends
// the task with token_rate_limited; nothing was taken, reserved or called.
func TestBucketWaitBound(t *testing.T) {
	m := answers(chat.Usage{})
	r := newRig(m)
	r.cfg.TokenWait = 20 * time.Second
	r.limiter = &fakeLimiter{BeforeCallFn: shortThen(15*time.Second, 10*time.Second)}
	r.sleeps = &sleepLog{}
	_, err := r.run(t, lisbon)
	if code, _, _ := task.FailureOf(err); code != codes.TokenRateLimited {
		t.Fatalf("err %v", err)
	}
	if w := r.sleeps.Waits(); !slices.Equal(w, []time.Duration{15 * time.Second}) {
		t.Fatalf("waits %v", w)
	}
	// Each ask's reserve was withdrawn: nothing stays reserved.
	if len(m.Turns()) != 0 || r.budget.Open() != 0 || len(r.budget.Withdrawn()) != len(r.budget.Reserved()) ||
		len(r.limiter.After()) != 0 || len(r.ledger.Entries()) != 0 {
		t.Fatalf("calls %d, reservations %d open, AfterCalls %d, ledger %d",
			len(m.Turns()), r.budget.Open(), len(r.limiter.After()), len(r.ledger.Entries()))
	}
}

// TestDefaultTokenWait: with no bound configured, govern.DefaultTokenWait holds.
func TestDefaultTokenWait(t *testing.T) {
	r := newRig(answers(chat.Usage{}))
	r.limiter = &fakeLimiter{BeforeCallFn: shortThen(govern.DefaultTokenWait, time.Millisecond)}
	r.sleeps = &sleepLog{}
	_, err := r.run(t, lisbon)
	if code, _, _ := task.FailureOf(err); code != codes.TokenRateLimited || len(r.sleeps.Waits()) != 1 {
		t.Fatalf("err %v after waits %v", err, r.sleeps.Waits())
	}
}

// TestBucketWaitsOnTheClock: the default sleep waits on the clock and
// ends with the run's context.
func TestBucketWaitsOnTheClock(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := newRig(answers(chat.Usage{}))
		r.limiter = &fakeLimiter{BeforeCallFn: shortThen(4 * time.Second)}
		start := time.Now()
		if _, err := r.run(t, lisbon); err != nil {
			t.Fatal(err)
		}
		if took := time.Since(start); took != 4*time.Second {
			t.Fatalf("took %v, want the 4s wait", took)
		}
	})
	synctest.Test(t, func(t *testing.T) {
		r := newRig(answers(chat.Usage{}))
		r.limiter = &fakeLimiter{BeforeCallFn: shortThen(15 * time.Second)}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		err := r.workflow().Run(ctx, record(lisbon), func(*task.Record, ...task.Event) error { return nil })
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("err %v, want the run's deadline", err)
		}
	})
}

// TestAfterCallOnEveryPath: whatever way a call ends after its tokens were
// taken, the bucket is settled with what the call was charged.
func TestAfterCallOnEveryPath(t *testing.T) {
	failing := func(context.Context, int, chat.Turn) (chat.Reply, error) { return chat.Reply{}, errors.New("500") }
	tests := []struct {
		name string
		rig  func(r *rig)
		// actual is what the first call is charged, given its prompt.
		actual func(prompt int64) int64
	}{
		{"success", func(r *rig) {}, func(int64) int64 { return 340 }},
		// Failed before a token came back: nothing was consumed.
		{"provider failure", func(r *rig) { r.models.Primary.Model.(*fakeModel).GenerateFn = failing },
			func(int64) int64 { return 0 }},
		{"cut stream", func(r *rig) {
			r.models.Primary.Model.(*fakeModel).GenerateFn = endless("Lisbon 里斯本 day ", "trams, 电车 and views; ")
			r.cfg.MaxTokens = 300
			r.cfg.LoopThreshold = 1
		}, func(prompt int64) int64 { return prompt + 300 }},
		{"budget refusal after the take", func(r *rig) { r.budget.Left = 10 }, func(int64) int64 { return 0 }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(answers(chat.Usage{PromptTokens: 300, CompletionTokens: 40, Reported: true}))
			r.limiter = &fakeLimiter{}
			tc.rig(r)
			_, _ = r.run(t, lisbon)
			b, a := r.limiter.Before(), r.limiter.After()
			if len(a) == 0 || len(a) != len(b) {
				t.Fatalf("%d BeforeCalls, %d AfterCalls", len(b), len(a))
			}
			want := tc.actual(b[0].PromptTokens)
			if a[0].Op != b[0].Op || a[0].Reserved != b[0].Amount || a[0].Actual != want {
				t.Fatalf("AfterCall %+v, want reserved %d and actual %d", a[0], b[0].Amount, want)
			}
		})
	}
}

// TestLimiterFailures: a limiter that cannot be asked fails the task closed
// before anything is reserved or called; an amount no bucket of the
// principal's rate can ever hold is token_rate_limited.
func TestLimiterFailures(t *testing.T) {
	for _, tc := range []struct {
		err  error
		code string
	}{
		{fmt.Errorf("%w: connection refused", ratelimit.ErrUnavailable), codes.AgentFailed},
		{fmt.Errorf("%w: 2000 tokens, capacity 200", ratelimit.ErrTooLarge), codes.TokenRateLimited},
	} {
		t.Run(tc.code, func(t *testing.T) {
			m := answers(chat.Usage{})
			r := newRig(m)
			r.limiter = &fakeLimiter{BeforeCallFn: func(context.Context, ratelimit.CallRequest) (ratelimit.CallDecision, error) {
				return ratelimit.CallDecision{}, tc.err
			}}
			_, err := r.run(t, lisbon)
			code, msg, _ := task.FailureOf(err)
			if code != tc.code || len(m.Turns()) != 0 || r.budget.Open() != 0 || len(r.budget.Withdrawn()) != len(r.budget.Reserved()) {
				t.Fatalf("err %v after %d calls and %d reservations open", err, len(m.Turns()), r.budget.Open())
			}
			if tc.code == codes.AgentFailed && !strings.Contains(msg, "could not be checked") {
				t.Fatalf("message %q", msg)
			}
		})
	}
}

// TestAfterCallFailureDoesNotStopARun: the bucket's settle is best effort
// like the budget's.
func TestAfterCallFailureDoesNotStopARun(t *testing.T) {
	r := newRig(answers(chat.Usage{}))
	r.limiter = &fakeLimiter{AfterCallFn: func(context.Context, string, int64, int64, int64, string) (int64, error) {
		return 0, ratelimit.ErrUnavailable
	}}
	rec, err := r.run(t, lisbon)
	if err != nil || rec.Result == nil || len(r.limiter.After()) != 1 {
		t.Fatalf("err %v, AfterCalls %d", err, len(r.limiter.After()))
	}
}
