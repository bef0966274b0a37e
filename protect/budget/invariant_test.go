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

	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/kit/testkit/redistest"
)

// TestInvariantUnderConcurrency runs on a real Redis, three ways: one
// replica reserving every call in the day's slot; two replicas (two
// Budgets) with leased blocks on one redis-server; and the same on the
// 3-master test cluster. 300 goroutines reserve random calls of two
// models at different prices against two budgets on separate keys (two
// days): one bound by tokens (a site budget of 400000 tokens, and a tier
// share of 150000), one bound by money (1200000 micro-units, tokens
// unbounded), so each cap is reached on its own however the machine
// schedules the workers. They settle below the hold, above it (overage),
// after ReleaseTask gave the hold back (late), or abandon the reservation
// to expiry. A checker samples each budget's site token and spend hashes
// in one MULTI/EXEC (so each sample is atomic; the day's scopes share a
// slot) and asserts settled + outstanding − overage ≤ limit in all four:
// leased blocks are outstanding, so the invariant holds whatever the
// replicas hold unspent. Once the replicas give their leases back, every
// token and micro-unit the settles reported is in Redis exactly once.
func TestInvariantUnderConcurrency(t *testing.T) {
	modes := []struct {
		name    string
		leases  bool
		cluster bool
	}{
		{"per-call", false, false},
		{"leased-two-replicas", true, false},
		{"leased-two-replicas-cluster", true, true},
	}
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			var rdb, probe redis.UniversalClient
			if m.cluster {
				redistest.WantCluster(t, false)
				cl := redistest.SharedCluster(t)
				rdb, probe = cl.Client(t), cl.Client(t)
			} else {
				be := redistest.Real(t)
				if err := be.Client.FlushDB(context.Background()).Err(); err != nil {
					t.Fatal(err)
				}
				rdb, probe = be.Client, be.Probe(t)
			}
			invariantUnderConcurrency(t, rdb, probe, m.leases)
		})
	}
}

func invariantUnderConcurrency(t *testing.T, rdb, probe redis.UniversalClient, leases bool) {
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
	// byTokens (index 0) and bySpend (1), each on its own day's keys, each
	// served by two replicas with leases (one without).
	days := [2]string{day, "2026-09-01"}
	limits := [2]Limits{{Site: siteLimit, Principal: 1 << 40, Task: 1 << 40},
		{Site: 1 << 40, Principal: 1 << 40, Task: 1 << 40, SpendMicro: spendLimit}}
	var replicas [2][]*Budget
	for bi, l := range limits {
		o := Options{Limits: l, Prices: testPrices, Now: clk.Now}
		n := 1
		if leases {
			// Short enough that the replicas' loops sweep abandoned holds
			// and give idle blocks back while the test runs.
			o.Lease, n = LeaseOptions{Calls: DefaultLeaseCalls, TTL: 2 * time.Second, Idle: 300 * time.Millisecond}, 2
		}
		for range n {
			b := New(rdb, o)
			t.Cleanup(func() { _ = b.Close(context.Background()) })
			replicas[bi] = append(replicas[bi], b)
		}
	}

	// What the settles reported, per principal: tokens, micro-units and
	// their overage parts.
	type sums struct{ tokens, cost, overTok, overCost atomic.Int64 }
	// scoped counts per budget and scope.
	type scoped struct {
		b int
		s Scope
	}
	var (
		charged   [2][principals]sums
		granted   atomic.Int64
		refused   sync.Map // scoped → *atomic.Int64
		abandoned atomic.Int64
		late      atomic.Int64
		excess    atomic.Int64
		warned    sync.Map // scoped → *atomic.Int64
		failures  = make(chan error, workers)
	)
	count := func(m *sync.Map, b int, s Scope) {
		v, _ := m.LoadOrStore(scoped{b, s}, new(atomic.Int64))
		v.(*atomic.Int64).Add(1)
	}
	load := func(m *sync.Map, b int, s Scope) int64 {
		if v, ok := m.Load(scoped{b, s}); ok {
			return v.(*atomic.Int64).Load()
		}
		return 0
	}
	ks := [2][2]string{{dayPrefix(days[0]) + "site", dayPrefix(days[0]) + "spend"}, {dayPrefix(days[1]) + "site", dayPrefix(days[1]) + "spend"}}

	// The checker samples until the workers are done. Violations are
	// counted, not sent: a broken invariant shows in every later sample,
	// and the checker must never block on a full channel.
	done := make(chan struct{})
	type sample struct {
		n, overTok, overSpend int64
		maxTok, maxSpend      int64 // settled + outstanding − overage: tokens of byTokens, spend of bySpend
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
			// One MULTI per day: its site and spend share the day's slot.
			var hashes [4]*redis.SliceCmd
			var err error
			for i, k := range ks {
				_, e := probe.TxPipelined(ctx, func(p redis.Pipeliner) error {
					hashes[2*i] = p.HMGet(ctx, k[0], "settled", "outstanding", "overage")
					hashes[2*i+1] = p.HMGet(ctx, k[1], "settled", "outstanding", "overage")
					return nil
				})
				err = errors.Join(err, e)
			}
			if err != nil {
				s.n = -1
				checked <- s
				return
			}
			var net, raw [4]int64
			for i, h := range hashes {
				v := h.Val()
				net[i], raw[i] = field(v[0])+field(v[1])-field(v[2]), field(v[0])+field(v[1])
			}
			s.n++
			s.maxTok, s.maxSpend = max(s.maxTok, net[0]), max(s.maxSpend, net[3])
			s.maxRawTok, s.maxRaw = max(s.maxRawTok, raw[0]), max(s.maxRaw, raw[3])
			// Each budget is bound by one cap, and the other is unbounded
			// (spend off in byTokens, 2^40 tokens in bySpend).
			if net[0] > siteLimit || net[2] > 1<<40 {
				s.overTok++
			}
			if net[3] > spendLimit {
				s.overSpend++
			}
		}
	}()

	began := time.Now()
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 42))
			bi := w % 2
			b := replicas[bi][(w/2)%len(replicas[bi])]
			pi := (w / 2) % principals
			req := Request{Day: days[bi], Principal: "v_" + strconv.Itoa(pi), Task: "t_" + strconv.Itoa(w)}
			if bi == 0 && pi%2 == 1 {
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
					count(&refused, bi, ex.Scope)
					continue
				}
				if err != nil {
					failures <- err
					return
				}
				granted.Add(1)
				for _, e := range r.Warnings {
					count(&warned, bi, e.Scope)
				}
				prompt, completion := req.PromptTokens, rng.Int64N(req.MaxTokens+1)
				switch n := rng.IntN(100); {
				case n < 10:
					abandoned.Add(1)
					continue
				case n < 13:
					// The lease lapsed: the reaper gives the hold back first.
					if _, err := b.ReleaseTask(ctx, req.Day, req.Principal, req.Task); err != nil {
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
					count(&warned, bi, e.Scope)
				}
				c := &charged[bi][pi]
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
	// settled is exactly what the settles reported, overage included. The
	// replicas give back what abandoned reservations held in their blocks
	// (their loops sweep them), then their leases, reporting every charge.
	clk.Advance(DefaultReservationTTL + time.Second)
	for _, bs := range replicas {
		for _, b := range bs {
			clocktest.Eventually(t, 10*time.Second, "abandoned leased holds swept", func() bool { return !b.open.anyLeased() })
			if err := b.Close(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}
	budgets := [2]*Budget{replicas[0][0], replicas[1][0]}
	var reps [2]UsageReport
	for bi, b := range budgets {
		var tokens, cost, overTok, overCost int64
		for pi := range principals {
			rep, err := b.Usage(ctx, UsageQuery{Day: days[bi], Principal: "v_" + strconv.Itoa(pi)})
			if err != nil {
				t.Fatal(err)
			}
			c := &charged[bi][pi]
			if rep.Reservations != 0 || rep.Site.Outstanding != 0 || rep.Spend.Outstanding != 0 || rep.Principal.Outstanding != 0 {
				t.Fatalf("budget %d after expiry: %+v", bi, rep)
			}
			if rep.Principal.Settled != c.tokens.Load() || rep.Principal.Overage != c.overTok.Load() {
				t.Fatalf("budget %d principal v_%d settled %+v; settles reported %d tokens, %d overage", bi, pi, rep.Principal, c.tokens.Load(), c.overTok.Load())
			}
			tokens += c.tokens.Load()
			cost += c.cost.Load()
			overTok += c.overTok.Load()
			overCost += c.overCost.Load()
		}
		rep, err := b.Usage(ctx, UsageQuery{Day: days[bi], Tier: partner, TierLimit: tierLimit})
		if err != nil {
			t.Fatal(err)
		}
		// A leased block absorbs a call's excess while it has room: the
		// day's scopes record as overage only what passed the blocks.
		overOK := rep.Site.Overage == overTok && rep.Spend.Overage == overCost
		if leases {
			overOK = rep.Site.Overage <= overTok && rep.Spend.Overage <= overCost
		}
		if rep.Site.Settled != tokens || rep.Spend.Settled != cost || !overOK {
			t.Fatalf("budget %d: site %+v spend %+v; settles reported %d tokens (%d over), %d micro-units (%d over)",
				bi, rep.Site, rep.Spend, tokens, overTok, cost, overCost)
		}
		reps[bi] = rep
	}
	if r := reps[0]; r.Site.Settled-r.Site.Overage > siteLimit || r.Tier.Settled-r.Tier.Overage > tierLimit {
		t.Fatalf("final state breaks the token invariant: site %+v tier %+v", r.Site, r.Tier)
	}
	if r := reps[1]; r.Spend.Settled-r.Spend.Overage > spendLimit {
		t.Fatalf("final state breaks the spend invariant: spend %+v", r.Spend)
	}
	if load(&refused, 0, ScopeSite) == 0 || load(&refused, 1, ScopeSpend) == 0 || s.n < 100 || late.Load() == 0 || excess.Load() == 0 {
		t.Fatalf("test did not exercise both caps: refusals site %d spend %d, %d samples, %d late, %d excess",
			load(&refused, 0, ScopeSite), load(&refused, 1, ScopeSpend), s.n, late.Load(), excess.Load())
	}
	// Each binding daily scope's 80% crossing was reported exactly once.
	for _, sc := range []scoped{{0, ScopeSite}, {0, ScopeTier}, {1, ScopeSpend}} {
		if n := load(&warned, sc.b, sc.s); n != 1 {
			t.Errorf("budget %d: %s crossed 80%% in %d reports; want exactly 1", sc.b, sc.s, n)
		}
	}
	t.Logf("%d workers x %d rounds in %v: %d granted; refused by site %d (tokens budget), spend %d (spend budget), tier %d; %d abandoned, %d late, %d over the hold",
		workers, rounds, elapsed.Round(time.Millisecond), granted.Load(), load(&refused, 0, ScopeSite), load(&refused, 1, ScopeSpend),
		load(&refused, 0, ScopeTier), abandoned.Load(), late.Load(), excess.Load())
	t.Logf("checker: %d samples; max settled+outstanding−overage %d of %d tokens, %d of %d micro-units; "+
		"max settled+outstanding %d tokens, %d micro-units",
		s.n, s.maxTok, siteLimit, s.maxSpend, spendLimit, s.maxRawTok, s.maxRaw)
	t.Logf("final: tokens budget site %+v tier %+v; spend budget spend %+v", reps[0].Site, reps[0].Tier, reps[1].Spend)
}

// field reads an HMGET value; a missing field is 0.
func field(v any) int64 {
	s, _ := v.(string)
	n, _ := strconv.ParseInt(s, 10, 64)
	return n
}
