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

// TestInvariantUnderConcurrency runs on a real Redis: 300 goroutines reserve
// random amounts against a site budget of 50000, settle random actuals or
// abandon the reservation to expiry, while a checker samples the site scope
// (settled and outstanding read by one HMGET, so each sample is atomic) and
// asserts settled + outstanding never exceeds the limit.
func TestInvariantUnderConcurrency(t *testing.T) {
	be := redistest.Real(t)
	rdb := be.Client
	// The checker has its own connection so it is not starved by the
	// workers queueing for the shared pool.
	opt, err := redis.ParseURL(be.URL)
	if err != nil {
		t.Fatal(err)
	}
	opt.PoolSize = 1
	probe := redis.NewClient(opt)
	t.Cleanup(func() { _ = probe.Close() })
	ctx := context.Background()
	const (
		siteLimit = 50000
		workers   = 300
		rounds    = 50
		visitors  = 30
	)
	clk := newClock(start)
	b := New(rdb, Options{
		Limits: Limits{Site: siteLimit, Visitor: 1 << 40, Task: 1 << 40},
		Now:    clk.Now,
	})

	var (
		charged    [visitors]atomic.Int64 // what Settle reported, per visitor
		granted    atomic.Int64
		refused    atomic.Int64
		abandoned  atomic.Int64
		expiredSet atomic.Int64 // settles that found their reservation expired
		failures   = make(chan error, workers)
	)
	siteKey := keysFor(day, visA, taskOne).site

	// The checker samples until the workers are done.
	done := make(chan struct{})
	// Violations are counted, not sent: a broken invariant shows in every
	// later sample, and the checker must never block on a full channel.
	type sample struct{ n, max, over int64 }
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
			v, err := probe.HMGet(ctx, siteKey, "settled", "outstanding").Result()
			if err != nil {
				s.n = -1
				checked <- s
				return
			}
			sum := field(v[0]) + field(v[1])
			s.n++
			s.max = max(s.max, sum)
			if sum > siteLimit {
				s.over++
			}
		}
	}()

	began := time.Now()
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 42))
			vi := w % visitors
			vis := "v" + strconv.Itoa(vi)
			task := "t" + strconv.Itoa(w)
			for range rounds {
				// Time moves on, so abandoned reservations expire mid-run.
				clk.Advance(100 * time.Millisecond)
				amount := 1 + rng.Int64N(600)
				r, err := b.Reserve(ctx, Request{Day: day, Visitor: vis, Task: task, Amount: amount})
				if errors.Is(err, ErrExhausted) {
					refused.Add(1)
					continue
				}
				if err != nil {
					failures <- err
					return
				}
				granted.Add(1)
				if rng.IntN(10) == 0 {
					abandoned.Add(1)
					continue
				}
				actual := rng.Int64N(amount + 1)
				got, err := b.Settle(ctx, r, actual)
				switch {
				case errors.Is(err, ErrUnknownReservation):
					expiredSet.Add(1)
				case err != nil:
					failures <- err
					return
				case got != actual:
					failures <- fmt.Errorf("settle(%d of %d) charged %d", actual, amount, got)
					return
				default:
					charged[vi].Add(got)
				}
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
		t.Fatal("checker could not read the site scope")
	}
	if s.over > 0 {
		t.Fatalf("invariant broken in %d of %d samples: max settled+outstanding %d > %d", s.over, s.n, s.max, siteLimit)
	}

	// Past every reservation's expiry, nothing may remain outstanding and
	// what was settled must be exactly what the settles reported.
	clk.Advance(DefaultReservationTTL + time.Second)
	var total int64
	for vi := range visitors {
		site, vis, _, n, err := b.Usage(ctx, day, "v"+strconv.Itoa(vi), "")
		if err != nil {
			t.Fatal(err)
		}
		if n != 0 || site.Outstanding != 0 || vis.Outstanding != 0 {
			t.Fatalf("after expiry: site %+v visitor %+v, %d reservations left", site, vis, n)
		}
		if vis.Settled != charged[vi].Load() {
			t.Fatalf("visitor v%d settled %d; settles reported %d", vi, vis.Settled, charged[vi].Load())
		}
		total += vis.Settled
	}
	site, _, _, _, _ := b.Usage(ctx, day, "", "")
	if site.Settled != total || site.Settled > siteLimit {
		t.Fatalf("site settled %d; sum of charges %d; limit %d", site.Settled, total, siteLimit)
	}
	if refused.Load() == 0 || s.n < 100 {
		t.Fatalf("test did not exercise the limit: %d refusals, %d samples", refused.Load(), s.n)
	}
	t.Logf("%d workers x %d rounds in %v: %d granted, %d refused, %d abandoned, %d settles after expiry; "+
		"checker took %d samples, max settled+outstanding %d of %d; final settled %d",
		workers, rounds, elapsed.Round(time.Millisecond), granted.Load(), refused.Load(), abandoned.Load(),
		expiredSet.Load(), s.n, s.max, siteLimit, site.Settled)
}

// field reads an HMGET value; a missing field is 0.
func field(v any) int64 {
	s, _ := v.(string)
	n, _ := strconv.ParseInt(s, 10, 64)
	return n
}
