package budget

import (
	"context"
	"reflect"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"faregate/protect/kit/testkit/redistest"
)

// TestLostReplyAppliedOnce: a reserve, settle or release whose reply is
// lost and that the client re-sends moves the counters exactly once, and a
// settle writes its ledger line once, on a single node and on the cluster
// (whose client re-sends of its own accord).
// Real Redis only: the loss happens on a real TCP connection.
func TestLostReplyAppliedOnce(t *testing.T) {
	type target struct {
		name string
		// rdb is the faulty client, the fixture's own, and the day the
		// keys use.
		rdb func(t *testing.T, f *redistest.Faults) (faulty, plain redis.UniversalClient, day string)
	}
	// A short read timeout makes the lost reply a quick timeout, which the
	// client retries on a fresh connection.
	const readTimeout = 250 * time.Millisecond
	targets := []target{
		{"redis", func(t *testing.T, f *redistest.Faults) (redis.UniversalClient, redis.UniversalClient, string) {
			be := redistest.Real(t)
			opt, err := redis.ParseURL(be.URL)
			if err != nil {
				t.Fatal(err)
			}
			opt.Dialer, opt.ReadTimeout, opt.MaxRetries = f.Dialer(nil), readTimeout, 3
			opt.MinRetryBackoff, opt.MaxRetryBackoff = time.Millisecond, 10*time.Millisecond
			c := redis.NewClient(opt)
			t.Cleanup(func() { _ = c.Close() })
			newFixture(t, be.Client, Limits{}) // a clean database
			return c, be.Client, day
		}},
		{"cluster", func(t *testing.T, f *redistest.Faults) (redis.UniversalClient, redis.UniversalClient, string) {
			cl := redistest.SharedCluster(t)
			opt, err := redis.ParseClusterURL(cl.URL)
			if err != nil {
				t.Fatal(err)
			}
			opt.Dialer, opt.ReadTimeout = f.Dialer(nil), readTimeout
			opt.MaxRetries = -1 // the cluster client re-sends anyway
			c := redis.NewClusterClient(opt)
			t.Cleanup(func() { _ = c.Close() })
			return c, cl.Client(t), day // SharedCluster is this test's alone, flushed
		}},
	}
	for _, tg := range targets {
		t.Run(tg.name, func(t *testing.T) {
			faults := redistest.NewFaults()
			rdb, plain, d := tg.rdb(t, faults)
			ctx := context.Background()
			// Load every script on every node first, so each armed EVALSHA
			// below runs (no NOSCRIPT, no EVAL fallback).
			load := func(ctx context.Context, c *redis.Client) error {
				for _, s := range []*redis.Script{batchScript, reserveScript, settleScript, releaseScript, canAffordScript, usageScript} {
					if err := s.Load(ctx, c).Err(); err != nil {
						return err
					}
				}
				return nil
			}
			switch c := plain.(type) {
			case *redis.ClusterClient:
				if err := c.ForEachShard(ctx, load); err != nil {
					t.Fatal(err)
				}
			case *redis.Client:
				if err := load(ctx, c); err != nil {
					t.Fatal(err)
				}
			}
			clk := newClock(start)
			reg := prometheus.NewRegistry()
			b := New(rdb, Options{Limits: Limits{SpendMicro: 1000000}, Prices: testPrices, ReservationTTL: time.Minute, Now: clk.Now, Registerer: reg})
			f := &fixture{b: New(plain, Options{Limits: b.Limits(), Prices: testPrices, ReservationTTL: time.Minute, Now: clk.Now}),
				rdb: plain, day: d, clk: clk, reg: reg, ctx: ctx}
			// lose runs op with the reply to its next EVALSHA lost: it must
			// succeed (the client re-sent it), and exactly one reply was lost.
			lose := func(op func() error) {
				t.Helper()
				before := faults.Lost()
				faults.LoseNextReply("evalsha") // go-redis writes command names in lower case
				if err := op(); err != nil {
					t.Fatalf("operation after a lost reply: %v", err)
				}
				if n := faults.Lost() - before; n != 1 {
					t.Fatalf("%d replies lost, want 1 (the fault did not fire)", n)
				}
			}

			// The day's layout is asked once per replica: before the faults.
			if _, err := b.Usage(ctx, UsageQuery{Day: d}); err != nil {
				t.Fatal(err)
			}
			req := Request{Day: d, Principal: keyA, Tier: partner, TierLimit: 100000, Task: taskOne, Model: "dear", PromptTokens: 100, MaxTokens: 100}
			q := UsageQuery{Principal: keyA, Tier: partner, Task: taskOne}
			var r Reservation
			lose(func() (err error) { r, err = b.Reserve(ctx, req); return err })
			held := su{0, 200, 0}
			f.check(t, q, state{site: held, spend: su{0, 1250, 0}, tier: held, principal: held, task: held, n: 1})

			var s Settlement
			// The settle writes the call's ledger line in the same script:
			// one line, however often the script arrived.
			entry := &Entry{Task: taskOne, Model: "dear", Principal: keyA, Outcome: OutcomeOK}
			lose(func() (err error) {
				s, err = b.SettleCall(ctx, r, Call{PromptTokens: 100, CompletionTokens: 150, Ledger: entry})
				return err
			})
			if n := plain.XLen(ctx, StreamOf(d, keyA)).Val(); n != 1 {
				t.Fatalf("ledger after a lost settle reply: %d lines; want 1", n)
			}
			want := Settlement{Tokens: 250, CostMicro: 1750, OverageTokens: 50, OverageCostMicro: 500}
			if !reflect.DeepEqual(s, want) {
				t.Fatalf("settle after a lost reply = %+v; want %+v", s, want)
			}
			done := su{250, 0, 50}
			f.check(t, q, state{site: done, spend: su{1750, 0, 500}, tier: done, principal: done, task: done})
			if v := testutil.ToFloat64(b.m.overageTokens.WithLabelValues(causeExcess)); v != 50 {
				t.Fatalf("overage metric = %v; want 50, counted once", v)
			}

			open, err := f.b.Reserve(ctx, req)
			if err != nil {
				t.Fatal(err)
			}
			var released int64
			lose(func() (err error) { released, err = b.ReleaseTask(ctx, d, keyA, taskOne); return err })
			if released != 1 {
				t.Fatalf("ReleaseTask after a lost reply = %d; want the first answer, 1", released)
			}
			f.check(t, q, state{site: done, spend: su{1750, 0, 500}, tier: done, principal: done, task: done})

			// The late settle of the released hold, its reply lost too: charged once.
			lose(func() (err error) { s, err = b.Settle(ctx, open, 10, 10); return err })
			if !s.Late || s.Tokens != 20 || s.OverageTokens != 20 {
				t.Fatalf("late settle after a lost reply = %+v", s)
			}
			lateDone := su{270, 0, 70}
			f.check(t, q, state{site: lateDone, spend: su{1875, 0, 625}, tier: lateDone, principal: lateDone, task: lateDone})
		})
	}
}
