package budget

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/protect/redistest"
)

// TestInvariantUnderConcurrency runs on a real Redis: 300 goroutines
// reserve random calls of two models at different prices against a site
// budget of 400000 tokens and 1200000 micro-units (and a tier share of 150000 tokens), then settle below the
// hold, above it (overage), after ReleaseTask gave the hold back (late), or
// abandon the reservation to expiry. A checker samples the site's token and
// spend hashes in one MULTI/EXEC (so each sample is atomic) and asserts
// settled + outstanding − overage ≤ limit in both. At the end every token
// and micro-unit the settles reported is in Redis exactly once.
func TestInvariantUnderConcurrency(t *testing.T) {
	be := redistest.Real(t)
	rdb := be.Client
	probe := be.Probe(t)
	ctx := context.Background()
	const (
		siteLimit  = 400000
		spendLimit = 1200000
		tierLimit  = 150000
		workers    = 300
		rounds     = 50
		principals = 30
	)
	models := []string{"cheap", "dear"}
	clk := newClock(start)
	b := New(rdb, Options{
		Limits: Limits{Site: siteLimit, Principal: 1 << 40, Task: 1 << 40, SpendMicro: spendLimit},
		Prices: testPrices,
		Now:    clk.Now,
	})

	// What the settles reported, per principal: tokens, micro-units and
	// their overage parts.
	type sums struct{ tokens, cost, overTok, overCost atomic.Int64 }
	var (
		charged   [principals]sums
		granted   atomic.Int64
		refused   sync.Map // Scope → *atomic.Int64
		abandoned atomic.Int64
		late      atomic.Int64
		excess    atomic.Int64
		warned    sync.Map // Scope → *atomic.Int64
		failures  = make(chan error, workers)
	)
	count := func(m *sync.Map, s Scope) {
		v, _ := m.LoadOrStore(s, new(atomic.Int64))
		v.(*atomic.Int64).Add(1)
	}
	load := func(m *sync.Map, s Scope) int64 {
		if v, ok := m.Load(s); ok {
			return v.(*atomic.Int64).Load()
		}
		return 0
	}
	k := keysFor(day, "", "", "")

	// The checker samples until the workers are done. Violations are
	// counted, not sent: a broken invariant shows in every later sample,
	// and the checker must never block on a full channel.
	done := make(chan struct{})
	type sample struct {
		n, overTok, overSpend int64
		maxTok, maxSpend      int64 // settled + outstanding − overage
		maxRawTok, maxRaw     int64 // settled + outstanding
	}
	checked := make(chan sample, 1)
	go func() {
		var s sample
		for {
			select {
			case <-done:
				checked <- s
				return
			default:
			}
			var site, spend *redis.SliceCmd
			_, err := probe.TxPipelined(ctx, func(p redis.Pipeliner) error {
				site = p.HMGet(ctx, k.site, "settled", "outstanding", "overage")
				spend = p.HMGet(ctx, k.spend, "settled", "outstanding", "overage")
				return nil
			})
			if err != nil {
				s.n = -1
				checked <- s
				return
			}
			tv, sv := site.Val(), spend.Val()
			tok := field(tv[0]) + field(tv[1]) - field(tv[2])
			sp := field(sv[0]) + field(sv[1]) - field(sv[2])
			s.n++
			s.maxTok, s.maxSpend = max(s.maxTok, tok), max(s.maxSpend, sp)
			s.maxRawTok, s.maxRaw = max(s.maxRawTok, field(tv[0])+field(tv[1])), max(s.maxRaw, field(sv[0])+field(sv[1]))
			if tok > siteLimit {
				s.overTok++
			}
			if sp > spendLimit {
				s.overSpend++
			}
		}
	}()

	began := time.Now()
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 42))
			pi := w % principals
			req := Request{Day: day, Principal: "v_" + strconv.Itoa(pi), Task: "t_" + strconv.Itoa(w)}
			if pi%2 == 1 {
				req.Tier, req.TierLimit = partner, tierLimit
			}
			for range rounds {
				// Time moves on, so abandoned reservations expire mid-run.
				clk.Advance(100 * time.Millisecond)
				req.Model = models[rng.IntN(2)]
				req.PromptTokens, req.MaxTokens = 1+rng.Int64N(300), 1+rng.Int64N(300)
				r, err := b.Reserve(ctx, req)
				var ex *ExhaustedError
				if errors.As(err, &ex) {
					count(&refused, ex.Scope)
					continue
				}
				if err != nil {
					failures <- err
					return
				}
				granted.Add(1)
				for _, e := range r.Warnings {
					count(&warned, e.Scope)
				}
				prompt, completion := req.PromptTokens, rng.Int64N(req.MaxTokens+1)
				switch n := rng.IntN(100); {
				case n < 10:
					abandoned.Add(1)
					continue
				case n < 13:
					// The lease lapsed: the reaper gives the hold back first.
					if _, err := b.ReleaseTask(ctx, day, req.Task); err != nil {
						failures <- err
						return
					}
				case n < 25:
					// The provider reports more than max_tokens.
					completion = req.MaxTokens + 1 + rng.Int64N(req.MaxTokens)
				}
				s, err := b.Settle(ctx, r, prompt, completion)
				if err != nil {
					failures <- err
					return
				}
				if s.Tokens != prompt+completion || s.CostMicro != testPrices[req.Model].Cost(prompt, completion) {
					failures <- fmt.Errorf("settle(%d+%d of %s) = %+v", prompt, completion, req.Model, s)
					return
				}
				if s.Late {
					late.Add(1)
				} else if s.OverageTokens > 0 {
					excess.Add(1)
				}
				for _, e := range s.Warnings {
					count(&warned, e.Scope)
				}
				c := &charged[pi]
				c.tokens.Add(s.Tokens)
				c.cost.Add(s.CostMicro)
				c.overTok.Add(s.OverageTokens)
				c.overCost.Add(s.OverageCostMicro)
			}
		})
	}
	wg.Wait()
	close(done)
	s := <-checked
	elapsed := time.Since(began)
	close(failures)
	for err := range failures {
		t.Fatal(err)
	}
	if s.n < 0 {
		t.Fatal("checker could not read the site scopes")
	}
	if s.overTok > 0 || s.overSpend > 0 {
		t.Fatalf("invariant broken in %d (tokens) and %d (spend) of %d samples: max %d of %d tokens, %d of %d micro-units",
			s.overTok, s.overSpend, s.n, s.maxTok, siteLimit, s.maxSpend, spendLimit)
	}

	// Past every reservation's expiry nothing is outstanding, and what was
	// settled is exactly what the settles reported, overage included.
	clk.Advance(DefaultReservationTTL + time.Second)
	var tokens, cost, overTok, overCost int64
	for pi := range principals {
		rep, err := b.Usage(ctx, UsageQuery{Day: day, Principal: "v_" + strconv.Itoa(pi)})
		if err != nil {
			t.Fatal(err)
		}
		c := &charged[pi]
		if rep.Reservations != 0 || rep.Site.Outstanding != 0 || rep.Spend.Outstanding != 0 || rep.Principal.Outstanding != 0 {
			t.Fatalf("after expiry: %+v", rep)
		}
		if rep.Principal.Settled != c.tokens.Load() || rep.Principal.Overage != c.overTok.Load() {
			t.Fatalf("principal v_%d settled %+v; settles reported %d tokens, %d overage", pi, rep.Principal, c.tokens.Load(), c.overTok.Load())
		}
		tokens += c.tokens.Load()
		cost += c.cost.Load()
		overTok += c.overTok.Load()
		overCost += c.overCost.Load()
	}
	rep, err := b.Usage(ctx, UsageQuery{Day: day, Tier: partner, TierLimit: tierLimit})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Site.Settled != tokens || rep.Site.Overage != overTok || rep.Spend.Settled != cost || rep.Spend.Overage != overCost {
		t.Fatalf("site %+v spend %+v; settles reported %d tokens (%d over), %d micro-units (%d over)",
			rep.Site, rep.Spend, tokens, overTok, cost, overCost)
	}
	if rep.Site.Settled-rep.Site.Overage > siteLimit || rep.Spend.Settled-rep.Spend.Overage > spendLimit ||
		rep.Tier.Settled-rep.Tier.Overage > tierLimit {
		t.Fatalf("final state breaks the invariant: site %+v spend %+v tier %+v", rep.Site, rep.Spend, rep.Tier)
	}
	if load(&refused, ScopeSite) == 0 || load(&refused, ScopeSpend) == 0 || s.n < 100 || late.Load() == 0 || excess.Load() == 0 {
		t.Fatalf("test did not exercise both caps: refusals site %d spend %d, %d samples, %d late, %d excess",
			load(&refused, ScopeSite), load(&refused, ScopeSpend), s.n, late.Load(), excess.Load())
	}
	// Each daily scope's 80% crossing was reported exactly once.
	for _, sc := range []Scope{ScopeSite, ScopeSpend, ScopeTier} {
		if n := load(&warned, sc); n != 1 {
			t.Errorf("%s crossed 80%% in %d reports; want exactly 1", sc, n)
		}
	}
	t.Logf("%d workers x %d rounds in %v: %d granted; refused by site %d, spend %d, tier %d; %d abandoned, %d late, %d over the hold",
		workers, rounds, elapsed.Round(time.Millisecond), granted.Load(), load(&refused, ScopeSite), load(&refused, ScopeSpend),
		load(&refused, ScopeTier), abandoned.Load(), late.Load(), excess.Load())
	t.Logf("checker: %d samples; max settled+outstanding−overage %d of %d tokens, %d of %d micro-units; "+
		"max settled+outstanding %d tokens, %d micro-units",
		s.n, s.maxTok, siteLimit, s.maxSpend, spendLimit, s.maxRawTok, s.maxRaw)
	t.Logf("final: site %+v spend %+v tier %+v", rep.Site, rep.Spend, rep.Tier)
}

// field reads an HMGET value; a missing field is 0.
func field(v any) int64 {
	s, _ := v.(string)
	n, _ := strconv.ParseInt(s, 10, 64)
	return n
}
