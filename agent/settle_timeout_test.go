package agent

import (
	"context"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"faregate/agent/chat"
	"faregate/agent/govern"
	"faregate/protect/budget"
)

// TestSettleWaitsConfigTimeout: a settle that takes 10 s to get through
// (a loaded store) is waited for when Config.SettleTimeout allows 30 s;
// the default gives up at 5 s and leaves the reservation to expire, which
// would give back tokens the provider billed.
func TestSettleWaitsConfigTimeout(t *testing.T) {
	for _, tc := range []struct {
		timeout time.Duration
		settled bool
	}{{30 * time.Second, true}, {0, false}} {
		synctest.Test(t, func(t *testing.T) {
			r := newRig(answers(chat.Usage{}))
			r.cfg.SettleTimeout = tc.timeout
			d := r.deps()
			var settled atomic.Bool
			b := newBudget(1 << 30)
			b.SettleFn = func(ctx context.Context, res budget.Reservation, prompt, completion int64) (budget.Settlement, error) {
				select {
				case <-time.After(10 * time.Second):
					settled.Store(true)
					return budget.Settlement{Tokens: prompt + completion}, nil
				case <-ctx.Done():
					return budget.Settlement{}, ctx.Err()
				}
			}
			d.Budget = b
			g := NewWorkflow(r.cfg, d).Governor()
			rec := record(lisbon)
			spec := govern.Spec{TaskID: rec.ID, Principal: govern.PrincipalOf(rec), Kind: "chat", PromptTokens: 100, Closing: true, MinOutput: 1}
			_, err := g.Call(context.Background(), spec, func(_ context.Context, a govern.Attempt) (govern.Outcome, error) {
				return govern.Outcome{Usage: govern.Usage{Prompt: 100, Completion: 10, Reported: true}, Counted: 10, FirstToken: true}, nil
			})
			if err != nil {
				t.Fatal(err)
			}
			if settled.Load() != tc.settled {
				t.Fatalf("SettleTimeout %v: settled %v, want %v", tc.timeout, settled.Load(), tc.settled)
			}
		})
	}
}
