package agent

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"faregate/agent/alert"
	"faregate/agent/chat"
	"faregate/agent/task"
	"faregate/protect/budget"
	"faregate/protect/codes"
	"faregate/protect/kit/testkit/redistest"
)

// TestHostileUsageChargedConservatively runs the workflow on the real
// budget and ledger: a provider that reports MaxInt64, negatives or an
// unreadable usage is charged the call's reservation (never 0, never a
// wrapped number), the task's usage and the ledger record that charge
// with the raw report beside it on the ledger, usage_implausible is
// raised for the model (no anomaly for the visitor), and the site's
// budget still counts afterwards.
func TestHostileUsageChargedConservatively(t *testing.T) {
	now := time.Date(2026, 8, 15, 12, 0, 0, 0, time.UTC)
	clock := func() time.Time { return now }
	cases := []struct {
		name  string
		usage chat.Usage
	}{
		{"max int64", chat.Usage{PromptTokens: math.MaxInt64, CompletionTokens: 1, Reported: true,
			Raw: `{"prompt_tokens":9223372036854775807,"completion_tokens":1}`}},
		{"negative", chat.Usage{PromptTokens: -50000, CompletionTokens: -50000, Reported: true,
			Raw: `{"prompt_tokens":-50000,"completion_tokens":-50000}`}},
		{"unreadable", chat.Usage{Reported: true, Unreadable: true, Raw: `{"prompt_tokens":1.5e400}`}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rdb := redistest.Mini(t).Client
			bud := budget.New(rdb, budget.Options{Now: clock, Limits: budget.Limits{Site: 20000, Principal: 20000, Task: 20000}})
			ledger := budget.NewLedger(rdb, clock)
			r := newRig(answers(c.usage))
			d := r.deps()
			d.Budget, d.Ledger = bud, ledger
			rec := record(lisbon)
			if err := NewWorkflow(r.cfg, d).Run(context.Background(), rec, func(*task.Record, ...task.Event) error { return nil }); err != nil {
				t.Fatal(err)
			}
			u, err := bud.Usage(context.Background(), budget.UsageQuery{Day: rec.Day, Principal: rec.Principal, Task: rec.ID})
			if err != nil {
				t.Fatal(err)
			}
			charged := rec.Usage.PromptTokens + rec.Usage.CompletionTokens
			if rec.Usage.PromptTokens <= 0 || rec.Usage.CompletionTokens <= 0 || u.Site.Settled != charged || u.Site.Outstanding != 0 {
				t.Fatalf("task usage %+v, site %+v: want the reservation charged, the same in both", rec.Usage, u.Site)
			}
			msgs, err := rdb.XRange(context.Background(), budget.StreamOf(rec.Day, rec.Principal), "-", "+").Result()
			if err != nil || len(msgs) != 1 {
				t.Fatalf("ledger %d entries, %v", len(msgs), err)
			}
			e := msgs[0].Values
			if e["reserved"] != fmt.Sprint(charged) || e["prompt_tokens"] != fmt.Sprint(rec.Usage.PromptTokens) ||
				e["implausible"] != "1" || e["usage_raw"] != c.usage.Raw || e["estimated"] != "1" {
				t.Fatalf("ledger entry %v: want the reservation of %d charged with the raw report", e, charged)
			}
			a := r.alerts.Of(alert.UsageImplausible)
			if len(a) != 1 || a[0].Scope != "model:primary" || a[0].Details["raw_usage"] != c.usage.Raw || a[0].Details["charged_tokens"] != charged {
				t.Fatalf("usage_implausible alerts %+v", a)
			}
			if len(r.alerts.Of(alert.Anomaly)) != 0 {
				t.Fatalf("the provider's report counted as the visitor's anomaly")
			}
			left := u.Site.Limit - u.Site.Settled
			if _, err := bud.Reserve(context.Background(), budget.Request{Day: rec.Day, Principal: "v_other", Task: "t_other", PromptTokens: left + 1}); err == nil {
				t.Fatalf("after the report the site granted %d tokens with %d left", left+1, left)
			}
		})
	}
}

// TestUnreadableAnswerChargedItsReservation: a 200 answer the adapter
// could not read (chat.ErrUnreadable) is charged its reservation, not the
// nothing a failure before the first token is charged.
func TestUnreadableAnswerChargedItsReservation(t *testing.T) {
	m := &fakeModel{GenerateFn: func(context.Context, int, chat.Turn) (chat.Reply, error) {
		return chat.Reply{}, fmt.Errorf("adapter: %w: not a completion", chat.ErrUnreadable)
	}}
	r := newRig(m)
	if _, err := r.run(t, lisbon); err == nil {
		t.Fatal("the run succeeded without an answer")
	}
	st := r.budget.Settled()
	if len(st) == 0 || st[0].Actual() != st[0].Reservation.Tokens {
		t.Fatalf("settlements %+v: want the first charged its reservation", st)
	}
	if a := r.alerts.Of(alert.UsageImplausible); len(a) == 0 || a[0].Details["raw_usage"] != "unreadable answer" {
		t.Fatalf("usage_implausible alerts %+v", a)
	}
}

// TestReasoningIsOutput: reasoning chunks count against the call's
// output like text: a model that only thinks is cut at the reservation
// (output_truncated) and charged what it streamed, not 0.
func TestReasoningIsOutput(t *testing.T) {
	var streamed int
	m := &fakeModel{GenerateFn: func(ctx context.Context, _ int, turn chat.Turn) (chat.Reply, error) {
		thought := strings.Repeat("hmm, ", 13000)
		for range 1000 {
			if err := turn.Stream(chat.Chunk{Reasoning: thought}); err != nil {
				return chat.Reply{}, err
			}
			streamed++
		}
		return plan(2), nil
	}}
	r := newRig(m)
	rec, _ := r.run(t, lisbon)
	if !slices.Contains(rec.Warnings, codes.OutputTruncated) {
		t.Fatalf("warnings %v: want output_truncated", rec.Warnings)
	}
	st := r.budget.Settled()
	if len(st) == 0 || st[0].Completion != int64(r.cfg.MaxTokens) || streamed >= 1000 {
		t.Fatalf("settlements %+v after %d chunks: want the first cut at its %d output tokens", st, streamed, r.cfg.MaxTokens)
	}
}
