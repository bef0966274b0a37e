package agent

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/agent/chat"
	"faregate/agent/govern"
	"faregate/agent/task"
	"faregate/protect/breaker"
	"faregate/protect/budget"
	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/kit/testkit/redistest"
	"faregate/protect/ratelimit"
)

// governedRig is the built-in governed call on the real budget, ledger and
// rate limiter (principal bucket and site pacing on), on client rdb.
func governedRig(rdb redis.UniversalClient) (*govern.Governor, govern.Spec) {
	g, spec, _ := governedRigOn(rdb)
	return g, spec
}

// governedRigOn is governedRig, with its rate limiter.
func governedRigOn(rdb redis.UniversalClient) (*govern.Governor, govern.Spec, *ratelimit.Limiter) {
	clock := func() time.Time { return time.Date(2026, 8, 15, 12, 0, 0, 0, time.UTC) }
	bud := budget.New(rdb, budget.Options{Now: clock, Limits: budget.Limits{Site: 1 << 40, Principal: 1 << 40, Task: 1 << 40}})
	r := newRig(answers(chat.Usage{}))
	d := r.deps()
	lim := ratelimit.New(rdb, ratelimit.Options{Now: clock})
	d.Budget, d.Ledger, d.Limiter = bud, budget.NewLedger(rdb, clock), lim
	cfg := r.cfg
	cfg.SiteTokensPerMinute = 10_000_000
	g := NewWorkflow(cfg, d).Governor()
	rec := record(lisbon)
	rec.Limits.TokensPerMinute, rec.Limits.TokensPerDay, rec.Limits.TierTokens = 10_000_000, 1<<40, 1<<40
	spec := govern.Spec{TaskID: rec.ID, RequestID: rec.RequestID, Principal: govern.PrincipalOf(rec), Kind: "chat", PromptTokens: 500, Label: "plan"}
	return g, spec, lim
}

// reported is an attempt that answers at once with the provider's usage.
func reported(context.Context, govern.Attempt) (govern.Outcome, error) {
	return govern.Outcome{Usage: govern.Usage{Prompt: 480, Completion: 120, Reported: true}, Counted: 120, FirstToken: true}, nil
}

// TestGovernedCallRoundTrips counts the Redis round trips on the critical
// path of one governed call of the built-in planner (principal bucket and
// site pacing on, ledger on), on miniredis, a real redis-server and a
// cluster (when cluster tests are on): before the upstream call, the
// bucket, the reservation and the site's turn are one round (three
// cluster slots, sent at once: bookAtOnce); after it, the settle with its
// ledger line, the site's turn and the principal's bucket are one.
func TestGovernedCallRoundTrips(t *testing.T) {
	targets := []struct {
		name string
		rdb  func(t *testing.T) redis.UniversalClient
	}{
		{"miniredis", func(t *testing.T) redis.UniversalClient { return redistest.Mini(t).Client }},
		{"redis", func(t *testing.T) redis.UniversalClient {
			opt, err := redis.ParseURL(redistest.Real(t).URL)
			if err != nil {
				t.Fatal(err)
			}
			c := redis.NewClient(opt)
			t.Cleanup(func() { _ = c.Close() })
			return c
		}},
		{"cluster", func(t *testing.T) redis.UniversalClient {
			redistest.WantCluster(t, false)
			return redistest.SharedCluster(t).Client(t)
		}},
	}
	for _, tg := range targets {
		t.Run(tg.name, func(t *testing.T) {
			rdb := tg.rdb(t)
			// On a cluster the reservation and its settle are a script in
			// each slot they touch, sent together: the principal's bucket
			// of the budget and, per call while leases are off, the day's
			// (one script on a single server, whose keys may share one).
			parts := 1
			if tg.name == "cluster" {
				parts = 2
			}
			h := &redistest.Rounds{}
			g, spec := governedRig(rdb)
			// A first call loads the scripts (EVALSHA, NOSCRIPT, EVAL), then
			// the counting starts.
			if _, err := g.Call(context.Background(), spec, reported); err != nil {
				t.Fatal(err)
			}
			rdb.AddHook(h)
			var before int
			var beforeNames []string
			h.Expect(2 + parts)
			out, err := g.Call(context.Background(), spec, func(ctx context.Context, a govern.Attempt) (govern.Outcome, error) {
				before, beforeNames, _ = h.Mark()
				h.Expect(2 + parts)
				return reported(ctx, a)
			})
			if err != nil || out.Charged.Prompt != 480 {
				t.Fatalf("call: %+v, %v", out, err)
			}
			after, afterNames, _ := h.Mark()
			beforeCmds, afterCmds := len(beforeNames), len(afterNames)
			t.Logf("before the upstream call: %d round trips, %d commands %v; after: %d round trips, %d commands %v",
				before, beforeCmds, beforeNames, after, afterCmds, afterNames)
			if after != 1 || afterCmds != 2+parts {
				t.Fatalf("after the upstream call: %d round trips of %d commands; want the settle (with the ledger, %d scripts), the site's turn and the principal's bucket in 1", after, afterCmds, parts)
			}
			if before != 1 || beforeCmds != 2+parts {
				t.Fatalf("before the upstream call: %d round trips of %d commands; want the bucket, the reservation (%d scripts) and the site's turn in 1", before, beforeCmds, parts)
			}
			n, err := rdb.XLen(context.Background(), budget.StreamOf(spec.Principal.Day, spec.Principal.ID)).Result()
			if err != nil || n != 2 {
				t.Fatalf("ledger: %d lines, %v; want one per call", n, err)
			}
		})
	}
}

// latency adds d to every command of a client: a network's round trip.
type latency struct{ d time.Duration }

func (l latency) DialHook(next redis.DialHook) redis.DialHook { return next }
func (l latency) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		simulateLatency(l.d)
		return next(ctx, cmd)
	}
}
func (l latency) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		simulateLatency(l.d)
		return next(ctx, cmds)
	}
}

// BenchmarkGovernedCall is one governed call of the built-in planner on a
// real redis-server, as above, with the provider answering at once: the
// cost of the guarantees around a model call. rtt=0 is loopback; rtt=1ms
// adds a millisecond to each command, as a Redis one network hop away
// would, which shows the round trips on the critical path.
func BenchmarkGovernedCall(b *testing.B) {
	be := redistest.Real(b)
	opt, err := redis.ParseURL(be.URL)
	if err != nil {
		b.Fatal(err)
	}
	for _, rtt := range []time.Duration{0, time.Millisecond} {
		b.Run("rtt="+rtt.String(), func(b *testing.B) {
			rdb := redis.NewClient(opt)
			b.Cleanup(func() { _ = rdb.Close() })
			if rtt > 0 {
				rdb.AddHook(latency{rtt})
			}
			g, spec := governedRig(rdb)
			ctx := context.Background()
			b.ResetTimer()
			for b.Loop() {
				if _, err := g.Call(ctx, spec, reported); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkPlannerRun is a whole run of the built-in planner with one
// model call (the answer), on the real budget, ledger and limiter: it
// exists in the same form before and after the Governor, so the two can
// be compared (see the commit that added it).
func BenchmarkPlannerRun(b *testing.B) {
	be := redistest.Real(b)
	opt, err := redis.ParseURL(be.URL)
	if err != nil {
		b.Fatal(err)
	}
	for _, rtt := range []time.Duration{0, time.Millisecond} {
		b.Run("rtt="+rtt.String(), func(b *testing.B) {
			rdb := redis.NewClient(opt)
			b.Cleanup(func() { _ = rdb.Close() })
			if rtt > 0 {
				rdb.AddHook(latency{rtt})
			}
			clock := func() time.Time { return time.Date(2026, 8, 15, 12, 0, 0, 0, time.UTC) }
			r := newRig(answers(chat.Usage{PromptTokens: 480, CompletionTokens: 120, Reported: true}))
			d := r.deps()
			d.Budget = budget.New(rdb, budget.Options{Now: clock, Limits: budget.Limits{Site: 1 << 40, Principal: 1 << 40, Task: 1 << 40}})
			d.Ledger = budget.NewLedger(rdb, clock)
			d.Limiter = ratelimit.New(rdb, ratelimit.Options{Now: clock})
			cfg := r.cfg
			cfg.SiteTokensPerMinute = 10_000_000
			w := NewWorkflow(cfg, d)
			ctx := context.Background()
			b.ResetTimer()
			for b.Loop() {
				rec := record(lisbon)
				rec.Limits.TokensPerMinute, rec.Limits.TokensPerDay, rec.Limits.TierTokens = 10_000_000, 1<<40, 1<<40
				if err := w.Run(ctx, rec, func(*task.Record, ...task.Event) error { return nil }); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestGovernorTaskCap: a caller other than the planner (the model
// endpoint of an operator's agent) is held to the task's token cap
// (FAREGATE_TASK_TOKEN_LIMIT) by the same reservation: a call that can
// afford its prompt and some output gets MaxOutput shrunk to what is left,
// one that cannot is refused with the task scope's ExhaustedError, and no
// attempt is made.
func TestGovernorTaskCap(t *testing.T) {
	rdb := redistest.Mini(t).Client
	clock := func() time.Time { return time.Date(2026, 8, 15, 12, 0, 0, 0, time.UTC) }
	bud := budget.New(rdb, budget.Options{Now: clock, Limits: budget.Limits{Site: 1 << 40, Principal: 1 << 40, Task: 2500}})
	r := newRig(answers(chat.Usage{}))
	d := r.deps()
	d.Budget, d.Ledger = bud, budget.NewLedger(rdb, clock)
	g := NewWorkflow(r.cfg, d).Governor()
	rec := record(lisbon)
	rec.Limits.TokensPerDay, rec.Limits.TierTokens = 1<<40, 1<<40
	spec := govern.Spec{TaskID: rec.ID, RequestID: "req-ext", Principal: govern.PrincipalOf(rec), Kind: "chat", PromptTokens: 500,
		Closing: true, MinOutput: 1, Label: "external"}
	var asked []int64
	attempt := func(_ context.Context, a govern.Attempt) (govern.Outcome, error) {
		asked = append(asked, a.MaxOutput)
		return govern.Outcome{Usage: govern.Usage{Prompt: 500, Completion: a.MaxOutput, Reported: true}, Counted: a.MaxOutput, FirstToken: true}, nil
	}
	for range 2 {
		if _, err := g.Call(context.Background(), spec, attempt); err != nil {
			t.Fatal(err)
		}
	}
	_, err := g.Call(context.Background(), spec, attempt)
	var ex *budget.ExhaustedError
	if !errors.As(err, &ex) || ex.Scope != budget.ScopeTask {
		t.Fatalf("third call: %v; want the task scope's refusal", err)
	}
	// 2500 = 500+1024, then 500+476 (what was left), then nothing.
	if len(asked) != 2 || asked[0] != 1024 || asked[1] != 476 {
		t.Fatalf("attempts asked for %v output tokens; want [1024 476]", asked)
	}
	u, err := bud.Usage(context.Background(), budget.UsageQuery{Day: rec.Day, Principal: rec.Principal, Task: rec.ID})
	if err != nil || u.Task.Settled != 2500 || u.Task.Outstanding != 0 {
		t.Fatalf("task scope %+v, %v; want 2500 settled, nothing held", u.Task, err)
	}
}

// TestGovernorNoFallbackAfterStart: an attempt whose answer had reached
// the client (Started) and then failed is not retried on the fallback;
// one that failed before is, with govern.Attempt.Fallback set, under its own
// reservation.
func TestGovernorNoFallbackAfterStart(t *testing.T) {
	for _, started := range []bool{true, false} {
		r := newRig(answers(chat.Usage{}))
		r.models.Fallback = &govern.Model{Model: answers(chat.Usage{}), Name: "cheap"}
		r.models.Breaker = breaker.New(breaker.Settings{MinCalls: 100, FailureRatio: 1, OpenFor: time.Hour}, nil, nil)
		g := r.workflow().Governor()
		rec := record(lisbon)
		var tried []string
		out, err := g.Call(context.Background(), govern.Spec{TaskID: rec.ID, Principal: govern.PrincipalOf(rec), PromptTokens: 100},
			func(_ context.Context, a govern.Attempt) (govern.Outcome, error) {
				tried = append(tried, fmt.Sprintf("%s/%v", a.Model.Name, a.Fallback))
				if !a.Fallback {
					return govern.Outcome{Started: started, FirstToken: true, Counted: 10}, errors.New("upstream reset")
				}
				return govern.Outcome{Usage: govern.Usage{Prompt: 100, Completion: 5, Reported: true}}, nil
			})
		want := "primary/false,cheap/true"
		if started {
			want = "primary/false"
		}
		if strings.Join(tried, ",") != want || (started == (err == nil)) {
			t.Fatalf("started %v: tried %v, err %v; want %s", started, tried, err, want)
		}
		if !started && (!out.FellBack || out.Model.Name != "cheap") {
			t.Fatalf("outcome %+v", out)
		}
		if st := r.budget.Settled(); len(st) != len(tried) || st[0].Actual() != 100+10 {
			t.Fatalf("started %v: settlements %+v; want the primary charged what it streamed, then the fallback's", started, st)
		}
	}
}

// simulateLatency stands for a network's round trip inside a Redis hook:
// the time passing is what the tests measure, not a wait for an event.
func simulateLatency(d time.Duration) { clocktest.Pass(d) }

// TestGovernorHold: a caller's hold (the model endpoint's task slot) goes
// with the Governor's bookings. When it refuses, its error comes back as
// it is, no attempt is made and nothing stays booked (the reservation
// withdrawn, the bucket's take and the turn given back); when the
// Governor refuses after it, or the attempt fails, its end is told so,
// once; when the attempt answers, its end gets the call's outcome.
func TestGovernorHold(t *testing.T) {
	rdb := redistest.Mini(t).Client
	g, spec := governedRig(rdb)
	bud := budget.New(rdb, budget.Options{})
	ctx := context.Background()
	held := func(refuse error) (*[]error, *[]govern.Result) {
		var errs []error
		var outs []govern.Result
		spec.Hold = func(context.Context) (govern.HoldEnd, error) {
			if refuse != nil {
				return nil, refuse
			}
			return func(_ context.Context, out govern.Result, err error) {
				outs = append(outs, out)
				errs = append(errs, err)
			}, nil
		}
		return &errs, &outs
	}
	attempts := 0
	counting := func(ctx context.Context, a govern.Attempt) (govern.Outcome, error) {
		attempts++
		return reported(ctx, a)
	}
	nothingHeld := func(when string) {
		t.Helper()
		u, err := bud.Usage(ctx, budget.UsageQuery{Day: spec.Principal.Day, Principal: spec.Principal.ID, Task: spec.TaskID})
		if err != nil || u.Task.Outstanding != 0 || u.Principal.Outstanding != 0 {
			t.Fatalf("%s: task %+v principal %+v, %v; want nothing outstanding", when, u.Task, u.Principal, err)
		}
	}

	tooMany := errors.New("too many calls")
	held(tooMany)
	if _, err := g.Call(ctx, spec, counting); !errors.Is(err, tooMany) || attempts != 0 {
		t.Fatalf("refused hold: %v, %d attempts", err, attempts)
	}
	nothingHeld("after a refused hold")

	errs, outs := held(nil)
	out, err := g.Call(ctx, spec, counting)
	if err != nil || attempts != 1 || len(*errs) != 1 || (*errs)[0] != nil ||
		(*outs)[0].Charged != out.Charged || (*outs)[0].Model.Name != out.Model.Name || out.Charged.Prompt != 480 {
		t.Fatalf("answered call: %+v %v; hold ended %v %+v", out, err, *errs, *outs)
	}

	errs, _ = held(nil)
	broken := errors.New("upstream reset")
	_, err = g.Call(ctx, spec, func(context.Context, govern.Attempt) (govern.Outcome, error) { return govern.Outcome{}, broken })
	if !errors.Is(err, broken) || len(*errs) != 1 || !errors.Is((*errs)[0], broken) {
		t.Fatalf("failed call: %v; hold ended %v", err, *errs)
	}

	errs, _ = held(nil)
	spec.Principal.TokensPerDay = 100 // less than the prompt
	_, err = g.Call(ctx, spec, counting)
	if !errors.Is(err, budget.ErrExhausted) || attempts != 1 || len(*errs) != 1 || !errors.Is((*errs)[0], budget.ErrExhausted) {
		t.Fatalf("refused by the budget: %v, %d attempts; hold ended %v", err, attempts, *errs)
	}
	nothingHeld("after a budget refusal")
}

// httpStatusError is a provider's error answer as an adapter reports it.
type httpStatusError struct{ status int }

func (e httpStatusError) Error() string   { return fmt.Sprintf("provider answered %d", e.status) }
func (e httpStatusError) HTTPStatus() int { return e.status }

// ledgerGovernor is a rig's governor on a budget and ledger in a
// miniredis of its own, on a fixed day, whose task scope holds taskCap
// tokens (the site and principal scopes hold more than any test spends).
func ledgerGovernor(t *testing.T, taskCap int64) (*redis.Client, *budget.Budget, *govern.Governor) {
	rdb := redistest.Mini(t).Client
	clock := func() time.Time { return time.Date(2026, 8, 15, 12, 0, 0, 0, time.UTC) }
	bud := budget.New(rdb, budget.Options{Now: clock, Limits: budget.Limits{Site: 1 << 40, Principal: 1 << 40, Task: taskCap}})
	r := newRig(answers(chat.Usage{}))
	d := r.deps()
	d.Budget, d.Ledger = bud, budget.NewLedger(rdb, clock)
	return rdb, bud, NewWorkflow(r.cfg, d).Governor()
}

// TestLedgerEntryForBilling: a governed call's ledger entry carries what
// billing reads: the principal's tier, the provider's HTTP status (200
// when it answered, its error status, 0 when no answer came), and the
// reasoning and cache tokens the provider reported (none when it
// reported no usage).
func TestLedgerEntryForBilling(t *testing.T) {
	rdb, _, g := ledgerGovernor(t, 1<<40)
	rec := record(lisbon)
	rec.Tier, rec.Limits.TokensPerDay, rec.Limits.TierTokens = "partner", 1<<40, 1<<40
	spec := govern.Spec{TaskID: rec.ID, RequestID: "req-bill", Principal: govern.PrincipalOf(rec), Kind: "chat", PromptTokens: 500,
		Closing: true, MinOutput: 1, Label: "external"}
	for _, attempt := range []func(context.Context, govern.Attempt) (govern.Outcome, error){
		func(context.Context, govern.Attempt) (govern.Outcome, error) {
			return govern.Outcome{Usage: govern.Usage{Prompt: 500, Completion: 90, Reported: true,
				Reasoning: 60, CacheCreation: 7, CacheRead: 300}, Counted: 90, FirstToken: true}, nil
		},
		func(context.Context, govern.Attempt) (govern.Outcome, error) {
			return govern.Outcome{}, httpStatusError{503}
		},
		func(context.Context, govern.Attempt) (govern.Outcome, error) {
			return govern.Outcome{}, errors.New("connection refused")
		},
	} {
		_, _ = g.Call(context.Background(), spec, attempt)
	}
	// The calls' entries are in the principal's stream (the day's holds
	// what the direct reservations charged the day's scopes).
	msgs, err := rdb.XRange(context.Background(), budget.StreamOf(rec.Day, rec.Principal), "-", "+").Result()
	if err != nil || len(msgs) != 3 {
		t.Fatalf("ledger: %d entries, %v", len(msgs), err)
	}
	for i, want := range []map[string]any{
		{"tier": "partner", "status": "200", "reasoning_tokens": "60", "cache_creation_input_tokens": "7", "cache_read_input_tokens": "300"},
		{"tier": "partner", "status": "503", "reasoning_tokens": "0", "cache_read_input_tokens": "0"},
		{"tier": "partner", "status": "0", "reasoning_tokens": "0", "cache_read_input_tokens": "0"},
	} {
		for k, v := range want {
			if msgs[i].Values[k] != v {
				t.Errorf("entry %d: %s = %v, want %v (%v)", i, k, msgs[i].Values[k], v, msgs[i].Values)
			}
		}
	}
}

// TestGovernorNoOutput: a call without output (embeddings, Spec.NoOutput)
// reserves its prompt only, is sent no output limit, and is refused, not
// shrunk, when even its prompt does not fit: 500 embedding calls in flight
// once each held a whole output limit (1,024 tokens) of their task.
func TestGovernorNoOutput(t *testing.T) {
	_, bud, g := ledgerGovernor(t, 1000)
	rec := record(lisbon)
	rec.Limits.TokensPerDay, rec.Limits.TierTokens = 1<<40, 1<<40
	spec := govern.Spec{TaskID: rec.ID, RequestID: "req-embed", Principal: govern.PrincipalOf(rec), Kind: "embeddings", PromptTokens: 300,
		Closing: true, MinOutput: 1, NoOutput: true, Label: "v1 embeddings"}
	var held []int64
	attempt := func(ctx context.Context, a govern.Attempt) (govern.Outcome, error) {
		u, err := bud.Usage(ctx, budget.UsageQuery{Day: rec.Day, Principal: rec.Principal, Task: rec.ID})
		if err != nil {
			return govern.Outcome{}, err
		}
		held = append(held, u.Task.Outstanding)
		if a.MaxOutput != 0 {
			t.Errorf("an embeddings attempt was given an output limit of %d", a.MaxOutput)
		}
		return govern.Outcome{Usage: govern.Usage{Prompt: 300, Reported: true}, FirstToken: true}, nil
	}
	for range 3 {
		if _, err := g.Call(context.Background(), spec, attempt); err != nil {
			t.Fatal(err)
		}
	}
	// 100 left: less than the prompt, and nothing to shrink.
	_, err := g.Call(context.Background(), spec, attempt)
	var ex *budget.ExhaustedError
	if !errors.As(err, &ex) || ex.Scope != budget.ScopeTask || len(held) != 3 {
		t.Fatalf("fourth call: %v after %d attempts; want the task scope's refusal after 3", err, len(held))
	}
	for _, h := range held {
		if h != 300 {
			t.Fatalf("held while in flight %v; want the prompt, 300, each time", held)
		}
	}
}
