package ratelimit

import (
	"context"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/protect/kit/testkit/redistest"
)

// TestBucketNeverBelowZeroButForOverage runs 200 concurrent workers, each
// taking from one principal's bucket before a "model call" and settling it
// after with random usage. A sampler on its own connection reads the stored
// level all along: it may go below zero only by recorded overage, so at
// every sample level ≥ −(overage recorded so far). Without overage that
// bound is zero, which catches even a slight overdraw; with overage it is
// the documented bound.
func TestBucketNeverBelowZeroButForOverage(t *testing.T) {
	be := redistest.Real(t)
	for _, c := range []struct {
		name    string
		overUse bool // settle with up to 1.5× the reservation
	}{
		{"without overage", false},
		{"with overage", true},
	} {
		t.Run(c.name, func(t *testing.T) {
			if err := be.Client.FlushDB(context.Background()).Err(); err != nil {
				t.Fatal(err)
			}
			runBucketInvariant(t, be, c.overUse)
		})
	}
}

func runBucketInvariant(t *testing.T, be redistest.Backend, overUse bool) {
	probe := be.Probe(t)
	ctx := context.Background()
	const (
		workers = 200
		rounds  = 15
		// 100 tokens/s refills 30 per call (the clock moves 300 ms a call);
		// the workers use more than that net per taken call, so the bucket
		// keeps running dry.
		rate = 6000
	)
	clk := newClock(start)
	l := New(be.Client, Options{Now: clk.Now})
	var (
		overage, taken, short atomic.Int64
		failures              = make(chan error, workers)
	)
	done := make(chan struct{})
	type tally struct{ samples, violations, lowest int64 }
	result := make(chan tally, 1)
	go func() {
		var s tally
		for {
			select {
			case <-done:
				result <- s
				return
			default:
			}
			// Overage is tallied before its AfterCall is sent, and read here
			// after the level, so the bound is never tighter than the truth.
			v, err := probe.HGet(ctx, key(keyAcme, "tpm"), "l").Int64()
			bound := -1000 * overage.Load()
			if err == redis.Nil {
				continue // never taken from yet: full
			}
			if err != nil {
				s.samples = -1
				result <- s
				return
			}
			s.samples++
			s.lowest = min(s.lowest, v)
			if v < bound {
				s.violations++
			}
		}
	}()
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 3))
			for i := range rounds {
				clk.Advance(300 * time.Millisecond)
				amount := 20 + rng.Int64N(180)
				d, err := l.BeforeCall(ctx, CallRequest{Scope: keyAcme, PromptTokens: 10 + rng.Int64N(10), Amount: amount,
					TokensPerMinute: rate, Op: "c-" + strconv.Itoa(w) + "-" + strconv.Itoa(i)})
				if err != nil {
					failures <- err
					return
				}
				if !d.Taken {
					short.Add(1)
					continue
				}
				taken.Add(1)
				actual := amount - rng.Int64N(amount/4+1) // mostly used
				if overUse {
					actual = rng.Int64N(amount * 3 / 2)
				}
				want := max(actual-amount, 0)
				overage.Add(want)
				got, err := l.AfterCall(ctx, keyAcme, rate, amount, actual, "s-"+strconv.Itoa(w)+"-"+strconv.Itoa(i))
				if err != nil {
					failures <- err
					return
				}
				if got != want {
					t.Errorf("overage %d; want %d", got, want)
				}
			}
		})
	}
	wg.Wait()
	close(done)
	s := <-result
	close(failures)
	for err := range failures {
		t.Fatal(err)
	}
	if s.samples <= 0 {
		t.Fatalf("sampler took %d samples", s.samples)
	}
	if s.violations > 0 {
		t.Fatalf("%d of %d samples below -overage (lowest %d milli-tokens, overage %d tokens)", s.violations, s.samples, s.lowest, overage.Load())
	}
	final, err := l.Level(ctx, keyAcme, rate)
	if err != nil || final < -float64(overage.Load()) {
		t.Fatalf("final level %v, %v; overage %d", final, err, overage.Load())
	}
	// The run must have exercised what it claims to.
	if taken.Load() == 0 || short.Load() == 0 || (overUse && overage.Load() == 0) {
		t.Fatalf("taken %d, short %d, overage %d: the bucket was not contended", taken.Load(), short.Load(), overage.Load())
	}
	t.Logf("%d taken, %d short, overage %d tokens, %d samples, lowest level %.3f tokens",
		taken.Load(), short.Load(), overage.Load(), s.samples, float64(s.lowest)/1000)
}
