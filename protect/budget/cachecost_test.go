package budget

import (
	"context"
	"testing"
	"time"

	"faregate/protect/kit/testkit/redistest"
)

// TestCachePricedApart: a call whose provider bills its prompt at cache
// prices is reserved at the dearest of them and settled with each part
// of its prompt at its own price: cache writes (an hour's among them) and
// reads apart from the rest, each bounded by the prompt charged.
func TestCachePricedApart(t *testing.T) {
	ctx := context.Background()
	// 3/15 per million, cache write 3.75, read 0.30, an hour's write 6.
	price := Price{InputMicroPerMTok: 3_000_000, OutputMicroPerMTok: 15_000_000}
	b := New(redistest.Mini(t).Client, Options{Prices: Prices{"claude": price}, Limits: Limits{Site: 1 << 30, SpendMicro: 1 << 40, Principal: 1 << 30},
		ReservationTTL: time.Minute})
	day := time.Now().UTC().Format("2006-01-02")
	for _, c := range []struct {
		name     string
		cache    bool
		call     Call
		reserved int64 // µ
		cost     int64 // µ
	}{
		// 1,000 prompt + 100 output: input 3,000 µ, output 1,500 µ.
		{"no cache", false, Call{PromptTokens: 1000, CompletionTokens: 100}, 4500, 4500},
		// Reserved at an hour's write (6 µ a token): 6,000 + 1,500.
		{"reads and writes", true, Call{PromptTokens: 1000, CompletionTokens: 100, CacheWrite: 200, CacheRead: 700},
			7500, 100*3 + 200*3.75 + 700*0.3 + 1500},
		{"an hour's write", true, Call{PromptTokens: 1000, CompletionTokens: 100, CacheWrite: 400, CacheWrite1h: 400},
			7500, 600*3 + 400*6 + 1500},
		// A report whose cache parts exceed its prompt is bounded by it.
		{"cache past the prompt", true, Call{PromptTokens: 1000, CompletionTokens: 100, CacheWrite: 900, CacheRead: 5000},
			7500, 900*3.75 + 100*0.3 + 1500},
		{"negative parts", true, Call{PromptTokens: 1000, CompletionTokens: 100, CacheWrite: -5, CacheRead: -5}, 7500, 4500},
	} {
		t.Run(c.name, func(t *testing.T) {
			r, err := b.Reserve(ctx, Request{Day: day, Principal: "v_cache", Task: "t_cache", Model: "claude",
				PromptTokens: 1000, MaxTokens: 100, PromptCache: c.cache})
			if err != nil {
				t.Fatal(err)
			}
			if r.CostMicro != c.reserved {
				t.Fatalf("reserved %d µ, want %d", r.CostMicro, c.reserved)
			}
			s, err := b.SettleCall(ctx, r, c.call)
			if err != nil {
				t.Fatal(err)
			}
			if s.CostMicro != c.cost || s.OverageCostMicro != 0 {
				t.Fatalf("settled %+v, want %d µ and no overage", s, c.cost)
			}
		})
	}
}
