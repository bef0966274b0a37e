package agent

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"faregate/agent/chat"
	"faregate/agent/govern"
	"faregate/agent/task"
	"faregate/protect/breaker"
	"faregate/protect/budget"
	"faregate/protect/codes"
	"faregate/protect/principal"
	"faregate/protect/ratelimit"
)

// trace records what happened, in order, across fakes.
type trace struct {
	mu  sync.Mutex
	all []string
}

func (t *trace) add(s string) {
	t.mu.Lock()
	t.all = append(t.all, s)
	t.mu.Unlock()
}

func (t *trace) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return strings.Join(t.all, ", ")
}

// pacedRig is a rig with site pacing on at 30000 tokens a minute.
func pacedRig(m chat.Model) *rig {
	r := newRig(m)
	r.cfg.SiteTokensPerMinute = 30000
	r.limiter = &fakeLimiter{}
	return r
}

// TestSitePacing: the call's turn at the site bucket is booked after its
// reservation and waited for before the model is called; the turn is
// settled with what the call used, and the step says it waited.
func TestSitePacing(t *testing.T) {
	var tr trace
	m := &fakeModel{GenerateFn: func(context.Context, int, chat.Turn) (chat.Reply, error) {
		tr.add("generate")
		rep := plan(2)
		rep.Usage = chat.Usage{PromptTokens: 300, CompletionTokens: 40, Reported: true}
		return rep, nil
	}}
	r := pacedRig(m)
	r.budget.ReserveFn = func(_ context.Context, req budget.Request) (budget.Reservation, error) {
		tr.add("reserve")
		return budget.Reservation{ID: "r1", Model: req.Model, Tokens: req.PromptTokens + req.MaxTokens}, nil
	}
	r.limiter.PaceFn = func(context.Context, string, int64, int64, time.Duration, string) (time.Duration, error) {
		tr.add("pace")
		return 7 * time.Second, nil
	}
	d := r.deps()
	d.Sleep = func(_ context.Context, d time.Duration) error {
		tr.add("sleep " + d.String())
		return nil
	}
	rec := record(lisbon)
	var events []task.Event
	err := NewWorkflow(r.cfg, d).Run(context.Background(), rec, func(_ *task.Record, evs ...task.Event) error {
		events = append(events, evs...)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := tr.String(); got != "reserve, pace, sleep 7s, generate" {
		t.Fatalf("order: %s", got)
	}
	prompt := chat.EstimatePrompt(m.Turns()[0].Messages, nil)
	p := r.limiter.Paces()
	if len(p) != 1 || p[0].Scope != ratelimit.SiteScope || p[0].Rate != 30000 || p[0].Amount != prompt+1024 ||
		p[0].MaxWait != govern.DefaultSitePaceWait || p[0].Op == "" {
		t.Fatalf("Pace %+v", p)
	}
	if a := r.limiter.AfterOf(ratelimit.SiteScope); len(a) != 1 || a[0].Op != p[0].Op || a[0].Reserved != prompt+1024 || a[0].Actual != 340 || a[0].TPM != 30000 {
		t.Fatalf("site AfterCall %+v", a)
	}
	r.events = events
	steps := r.steps(t)
	if s := steps[len(steps)-1]; s.Detail != "primary (waited 7s for tokens)" {
		t.Fatalf("step %+v", s)
	}
}

// TestSitePacingOutsideTheBreaker: the wait for a turn is not part of the
// call the breaker times, so a long wait never makes a call slow.
func TestSitePacingOutsideTheBreaker(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := pacedRig(answers(chat.Usage{}))
		r.limiter.PaceFn = func(context.Context, string, int64, int64, time.Duration, string) (time.Duration, error) {
			return 25 * time.Second, nil
		}
		r.models.Breaker = breaker.New(breaker.Settings{MinCalls: 1, MinPrincipals: 1, SlowCall: 5 * time.Second, SlowRatio: 0.5, OpenFor: time.Hour}, nil, nil)
		start := time.Now()
		if _, err := r.run(t, lisbon); err != nil {
			t.Fatal(err)
		}
		if took := time.Since(start); took != 25*time.Second {
			t.Fatalf("the run took %v, want the 25s wait", took)
		}
		if st := r.models.Breaker.State(); st != breaker.Closed {
			t.Fatalf("breaker %s after a paced call", st)
		}
	})
}

// TestSitePacingTooLong: a turn beyond SitePaceWait ends the task with
// token_rate_limited; the reservation is given back whole, the principal's
// tokens are refunded, and nothing reaches the model or the ledger.
func TestSitePacingTooLong(t *testing.T) {
	m := answers(chat.Usage{})
	r := pacedRig(m)
	r.cfg.SitePaceWait = 10 * time.Second
	r.limiter.PaceFn = func(_ context.Context, _ string, _, _ int64, maxWait time.Duration, _ string) (time.Duration, error) {
		return 0, &ratelimit.WaitTooLongError{Wait: 45 * time.Second, MaxWait: maxWait, After: 35 * time.Second}
	}
	_, err := r.run(t, lisbon)
	if code, _, _ := task.FailureOf(err); code != codes.TokenRateLimited {
		t.Fatalf("err %v", err)
	}
	if p := r.limiter.Paces(); len(p) != 1 || p[0].MaxWait != 10*time.Second {
		t.Fatalf("Pace %+v", p)
	}
	st := r.budget.Settled()
	if len(st) != 1 || st[0].Actual() != 0 || r.budget.Left != 1_000_000 {
		t.Fatalf("settlements %+v, left %d: the reservation was not given back", st, r.budget.Left)
	}
	b := r.limiter.Before()
	if a := r.limiter.AfterOf(principal.FromAccount(visitor).Scope()); len(a) != 1 || a[0].Reserved != b[0].Amount || a[0].Actual != 0 {
		t.Fatalf("principal AfterCall %+v", a)
	}
	if a := r.limiter.AfterOf(ratelimit.SiteScope); len(a) != 0 {
		t.Fatalf("site AfterCall %+v for a turn never booked", a)
	}
	if len(m.Turns()) != 0 || len(r.ledger.Entries()) != 0 {
		t.Fatalf("%d model calls, ledger %+v", len(m.Turns()), r.ledger.Entries())
	}
}

// TestSitePacingFailures: a limiter that cannot be asked fails the task
// closed; a call no site bucket can hold is token_rate_limited. Either
// way the reservation and the principal's tokens come back.
func TestSitePacingFailures(t *testing.T) {
	for _, tc := range []struct {
		err  error
		code string
	}{
		{fmt.Errorf("%w: connection refused", ratelimit.ErrUnavailable), codes.AgentFailed},
		{fmt.Errorf("%w: 70000 tokens, capacity 60000", ratelimit.ErrTooLarge), codes.TokenRateLimited},
	} {
		t.Run(tc.code, func(t *testing.T) {
			m := answers(chat.Usage{})
			r := pacedRig(m)
			r.limiter.PaceFn = func(context.Context, string, int64, int64, time.Duration, string) (time.Duration, error) {
				return 0, tc.err
			}
			_, err := r.run(t, lisbon)
			if code, _, _ := task.FailureOf(err); code != tc.code || len(m.Turns()) != 0 {
				t.Fatalf("err %v after %d model calls", err, len(m.Turns()))
			}
			if r.budget.Left != 1_000_000 || len(r.limiter.AfterOf(principal.FromAccount(visitor).Scope())) != 1 {
				t.Fatalf("left %d, principal AfterCalls %+v", r.budget.Left, r.limiter.After())
			}
		})
	}
}

// TestSitePacingEndsWithTheRun: a run whose time ends during the wait
// gives its turn and its reservation back.
func TestSitePacingEndsWithTheRun(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := answers(chat.Usage{})
		r := pacedRig(m)
		r.limiter.PaceFn = func(context.Context, string, int64, int64, time.Duration, string) (time.Duration, error) {
			return 29 * time.Second, nil
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		err := r.workflow().Run(ctx, record(lisbon), func(*task.Record, ...task.Event) error { return nil })
		if !errors.Is(err, context.DeadlineExceeded) || len(m.Turns()) != 0 {
			t.Fatalf("err %v after %d model calls", err, len(m.Turns()))
		}
		p := r.limiter.Paces()
		a := r.limiter.AfterOf(ratelimit.SiteScope)
		if len(a) != len(p) || a[0].Op != p[0].Op || a[0].Actual != 0 || a[0].Reserved != p[0].Amount {
			t.Fatalf("paces %+v, site AfterCalls %+v", p, a)
		}
		if r.budget.Left != 1_000_000 {
			t.Fatalf("left %d", r.budget.Left)
		}
	})
}

// TestSitePacingAndFallback: the fallback after a failed primary books a
// turn of its own (the primary's was settled with what it cost: nothing,
// as it failed before a token came back); after an open breaker it keeps
// the unused one.
func TestSitePacingAndFallback(t *testing.T) {
	failing := func(context.Context, int, chat.Turn) (chat.Reply, error) { return chat.Reply{}, errors.New("503") }
	cheap := func() *govern.Model {
		return &govern.Model{Model: answers(chat.Usage{PromptTokens: 300, CompletionTokens: 50, Reported: true}), Name: "cheap"}
	}
	t.Run("failed primary", func(t *testing.T) {
		r := pacedRig(&fakeModel{GenerateFn: failing})
		r.models.Fallback = cheap()
		r.models.Breaker = breaker.New(breaker.Settings{OpenFor: time.Hour}, nil, nil)
		if _, err := r.run(t, lisbon); err != nil {
			t.Fatal(err)
		}
		p := r.limiter.Paces()
		a := r.limiter.AfterOf(ratelimit.SiteScope)
		if len(p) != 2 || p[0].Op == p[1].Op || len(a) != 2 {
			t.Fatalf("paces %+v, site AfterCalls %+v", p, a)
		}
		// The primary failed before a token came back: it used nothing.
		if a[0].Op != p[0].Op || a[0].Actual != 0 || a[1].Op != p[1].Op || a[1].Actual != 350 {
			t.Fatalf("site AfterCalls %+v: want nothing for the failed primary, then the fallback's 350", a)
		}
		if pa := r.limiter.AfterOf(principal.FromAccount(visitor).Scope()); len(pa) != 1 || pa[0].Actual != a[0].Actual+350 {
			t.Fatalf("principal AfterCall %+v: want both attempts' charges", pa)
		}
	})
	t.Run("open breaker", func(t *testing.T) {
		primary := answers(chat.Usage{})
		r := pacedRig(primary)
		r.models.Fallback = cheap()
		r.models.Breaker = breaker.New(breaker.Settings{MinCalls: 1, MinPrincipals: 1, FailureRatio: 0.5, OpenFor: time.Hour}, nil, nil)
		_ = r.models.Breaker.Do(context.Background(), "v_test", func(context.Context, *breaker.Call) error { return errors.New("down") })
		if _, err := r.run(t, lisbon); err != nil {
			t.Fatal(err)
		}
		p := r.limiter.Paces()
		a := r.limiter.AfterOf(ratelimit.SiteScope)
		if len(p) != 1 || len(a) != 1 || a[0].Op != p[0].Op || a[0].Actual != 350 || len(primary.Turns()) != 0 {
			t.Fatalf("paces %+v, site AfterCalls %+v", p, a)
		}
	})
}

// TestSitePacingOff: without a site rate, or without a limiter, nothing
// is paced.
func TestSitePacingOff(t *testing.T) {
	r := newRig(answers(chat.Usage{}))
	r.limiter = &fakeLimiter{}
	if _, err := r.run(t, lisbon); err != nil {
		t.Fatal(err)
	}
	if p := r.limiter.Paces(); len(p) != 0 {
		t.Fatalf("paced with the site rate off: %+v", p)
	}
	r = newRig(answers(chat.Usage{}))
	r.cfg.SiteTokensPerMinute = 30000
	if _, err := r.run(t, lisbon); err != nil {
		t.Fatal(err)
	}
}
